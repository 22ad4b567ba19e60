"""Rows and prompts: the built-in datasets' catalogue (:mod:`~fedcybgd.data.catalogue`, names,
task kinds, fields; standard library only, so the run config can check names without the data
stack) and their rows (:mod:`~fedcybgd.data.builtin`), users' files (:mod:`~fedcybgd.data.sources`),
partitioners (:mod:`~fedcybgd.data.partition`) and prompt encoding and batches
(:mod:`~fedcybgd.data.prompts`).

What a task does with rows (its splits, federated shares, batches) is :mod:`fedcybgd.tasks`'s:
:mod:`fedcybgd.tasks.shares`. Empty on purpose: importing a submodule stays light.
"""
