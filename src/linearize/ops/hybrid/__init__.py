"""The LoLCATs hybrid's Triton kernels and recurrent states (the PyTorch forms are ``ops/hybrid_attention.py``
and ``ops/sparse_hybrid_attention.py``)."""
