"""Run the app on Flower's Deployment Engine: real SuperLink and SuperNode processes.

``commands`` builds the exact argument lists (shared by the loopback launcher and
``docker-compose.yml``), ``certs`` makes the TLS certificates and SuperNode keys, ``gateway``
is the Fleet gateway SuperNodes dial under TLS (it forwards the Fleet API alone, keeping the
SuperLink's Control and Runtime APIs off the nodes' address), and ``local`` starts the whole
topology on 127.0.0.1 (``python -m fedcybgd.deploy.local``).
"""
