"""Pipeline mode, a stage's side: the chunk of layers a node trains (:mod:`.stage`) and its
turn, one ``train.pipeline`` message (:mod:`.turn`). The server's side is
:mod:`fedcybgd.server.pipeline`.
"""
