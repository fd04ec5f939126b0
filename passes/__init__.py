"""Graph rewrites that turn eager model code into kda_compile ops during torch.compile."""
