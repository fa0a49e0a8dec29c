"""The pure device side: types, the ops of one device or a mesh, both protocols' resolve
bodies, the debug checks and the row kernel. Imports nothing from `host` or `map`."""
