"""Built-in passes. Each module registers its passes with ``fxopt.register_pass``."""
