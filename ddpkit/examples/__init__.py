"""Runnable examples that ship with the package: ``python -m ddpkit.examples.seresnext_lmdb``.

``seresnext_lmdb`` trains a timm SE-ResNeXt on LMDB data with DDP on one
process, one node or several (``torchrun -m ddpkit.examples.seresnext_lmdb``),
and ``--demo`` runs it end to end on generated shapes. It needs timm
(``pip install "ddpkit[examples]"``).
"""
