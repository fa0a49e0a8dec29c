"""The host side: a caller's arrays turned into an executable's arguments (validation,
buckets, placement, packing). Imports from `ops`, never from `map`."""
