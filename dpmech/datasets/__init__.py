"""Datasets in [-1, 1]: the named ones and their splits (splits), offline full MNIST (mnist), and a
user's own dataset or model given by import path (user_code)."""
