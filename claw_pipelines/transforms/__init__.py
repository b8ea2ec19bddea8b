"""Pure transforms: frames in, frames out. No lake paths, no Dagster, no servers."""
