"""pdplan: PipeDream's partitioner over a layer graph, writing an editable stage plan."""
