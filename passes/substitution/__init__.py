"""Trace-time substitution: functions Dynamo traces in place of known KDA / GDN entry points, before any
graph exists. ``install.py`` registers them (now, and through an import hook for modules imported later),
``registry.py`` keeps what is substituted, ``substitutes.py`` holds the substitutes, and ``sites.py``
reports the sites they produced in a compiled graph.
"""
