"""Membership and label inference attacks as a privacy measurement (docs/mia.md): the game, reference
models, offline RMIA and LiRA, label inference, and their metrics (lower bounds; epsilon is an upper one)."""
