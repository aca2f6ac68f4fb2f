"""pdprof: profile a PyTorch model into a layer graph (JSON) and a profile table (Parquet)."""
