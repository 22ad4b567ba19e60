"""Client memory: what a round takes, measured (``measure``: sampled RSS) and estimated before
it runs (``estimate``: the model behind ``memory-budget-mb``, neutral for both sides).

Empty on purpose: the server imports ``estimate`` without the sampler thread of ``measure``.
"""
