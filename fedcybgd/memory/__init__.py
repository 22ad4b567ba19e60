"""Client memory estimated before a round runs (``estimate``: the model behind
``memory-budget-mb``, shared by both sides). Measuring a process's memory is
:mod:`fedcybgd.core.measure`'s.
"""
