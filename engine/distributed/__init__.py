"""Tensor parallelism: one model split over the GPUs of one host, one process per GPU
(engine/distributed/*).

sharding: which heads, columns and vocabulary rows a rank holds; comm: its collectives; plan: the
step plans rank 0 broadcasts; launch: starting and watching the other ranks; follower: a rank other
than 0. Importing this package imports nothing heavy (a worker starts the ranks before it imports
torch).
"""
