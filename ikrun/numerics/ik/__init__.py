"""ik's CPU arithmetic (--numerics ik): arithmetic.py implements the Numerics interface from its activation formats
(formats.py), integer and float kernels (qgemm.py, ikgemm.py) and attention kernels (attention.py)."""
