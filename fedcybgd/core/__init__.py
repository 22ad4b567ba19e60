"""The leaf of the package: utilities that import nothing else of fedcybgd.

``fields`` (typed, checked settings: the run config's machinery), ``registry`` (named plug-in
registries and loading users' modules), ``atomic`` (crash-safe file writes), ``checksum``
(content checksums of tensors) and ``measure`` (a process's memory: RSS sampling, allocator
control).
"""
