"""The simulation and test harness: in-process and process Grids (``loopback``, ``procgrid``)
and fault injection (``faults``). Operator-side only: kept out of the app bundle (pyproject's
``fab-exclude``), and nothing a ServerApp or ClientApp runs imports it.
"""
