"""The write-ahead log, the heart of the gateway's promise: a 2xx means the record is here.

- `layout`: the WAL directory's file names, suffixes and locks, in one place;
- `frames`: a record as a checksummed frame, and reading a segment back;
- `log`: `WriteAheadLog`, appends and group commit into segments;
- `scheduling`: who runs each fdatasync (the event loop, or the syncer) and when;
- `syncer`: the process that runs fdatasyncs and hands sealed segments over;
- `flusher`: the process that lands sealed segments in `bronze/events`.

Kept free of imports here: the syncer and flusher processes start from this package.
"""
