"""The map: the FutureMap class, its engine step, the executables and their warm-up, host
reads and the debug channel. Imports from `host` and `ops`."""
