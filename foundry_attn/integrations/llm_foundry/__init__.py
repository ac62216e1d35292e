"""LLM-Foundry glue: the registered model, dataloaders and tiny offline assets."""
