"""Memory planning: liveness-based arena placement, its lower bound, and an arena executor."""
