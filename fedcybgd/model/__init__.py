"""Model plumbing: loading a causal LM (``loading``), cutting it into blocks (``blocks``) and
running it piece by piece (``layerwise``). Both sides of the app use it.

Empty on purpose: importing one module (e.g. ``loading`` in the Docker build) pulls no other.
"""
