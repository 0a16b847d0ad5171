"""The op over several devices: heads sharded (sharding.py), the token axis split into chunks with the keys
all-gathered or passed round a ring (context_parallel.py, ring.py; a chunk's pieces in pieces.py, the key
rows it reads in key_windows.py), and the balanced chunk order and
document packer that even out causal work per device (load_balance.py)."""
