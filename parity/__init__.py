"""parity: the same overlap scenarios through fm_torch and fm_jax, compared bit for bit.

Data flows one way: scenario -> driver -> FutureMap twin -> trace -> comparison -> report.
The console script `fm-parity` (parity.cli) runs the catalogue (parity.catalogue).
"""
