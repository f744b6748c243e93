"""The operators' and agents' pages: the overview, the runs, a run with its
plan as a DAG, the hosts, and their one websocket, server-rendered from the
templates beside them (``templates/pages/``). They read through the kernel's
selectors and act through its services; live updates come from the kernel's
relay (``runs/relay.py``)."""
