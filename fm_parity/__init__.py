"""parity: the same overlap scenarios through fm_torch and fm_jax, compared bit for bit.

Data flows one way, for one device, a mesh and many processes alike: scenario -> driver ->
FutureMap twin -> trace -> comparison -> report. What the twins must agree on and what is
compared: docs/CONTRACT.md. The console script `fm-parity` (fm_parity.cli) runs the catalogue
(fm_parity.catalogue).
"""
