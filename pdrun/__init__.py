"""pdrun: run a stage plan as pipeline-parallel workers over torch.distributed."""
