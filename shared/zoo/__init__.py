"""Built-in models (plain torch.nn) and offline datasets, named by ``zoo:NAME`` specs."""
