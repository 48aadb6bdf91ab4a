"""Robustness tools shared by every mechanism: attacks, PixelDP's noise layer, certification of
any noisy model, randomized smoothing, and accuracy under attack / certified accuracy (evaluation)."""
