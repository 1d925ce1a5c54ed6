"""Corpus formats behind one contract (base.py), one module each, chosen once (registry.py); a
clip's address typed (address.py). Nothing is imported here: the walks below (shards.py, shar.py)
import the addresses without the formats. docs/design/index.md, "Corpus formats".
"""
