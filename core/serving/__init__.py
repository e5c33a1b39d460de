"""Serving (issue 37): ftune runs vLLM's OpenAI server and owns what it does not know - which
tenant may use which model name, which job and checkpoint a name means, where its files are,
where the engine runs, when it stops, and what was used.

names.py (ft: names), resolve.py (a name -> what to serve, tenant-confined), tables.py and
deployments.py (the deployment rows and their states), adapters.py (adapters loaded, LRU),
engine.py (the engine's installation and command line), access.py (``open_model``: the
one call a client of a deployment makes - the API's router, an eval run)."""
