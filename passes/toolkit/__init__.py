"""The matching toolkit every rewrite uses: op families and patterns as data (``matching.py``) and the
helpers that read and edit Dynamo FX graphs (``graph_tools.py``). Nothing here knows a model or an op.
"""
