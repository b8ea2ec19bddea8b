"""The lake: Delta tables and the files beside them, in a local folder or an object store.
Everything above reads and writes through here.

- `delta`: `Lake`, the only module that builds table URIs and storage options and reads and
  writes Delta (appends, predicate overwrites, change feeds, compaction, commit metadata);
- `object_store`: the object store under a remote lake, and the conditional-put probe every
  writer runs before its first write;
- `specs`: the curation specs kept in the lake (`specs/<name>.yaml`) and the built-in ones;
- `policy`: the policy versions a trainer publishes (`gold/policy_versions`);
- `tokenizers`: the tokenizers of the lake's steps (`_tokenizers/<fingerprint>/`);
- `decoding`: a step's token ids back into text and chat messages, with its own tokenizer;
- `catalog`: what a lake holds: whether there is one at all, and its gold datasets.
- `prompts`: silver and gold steps read back with their whole prompts (they are stored
  relative to earlier steps), for us, DuckDB (`claw_steps`) and pyarrow.
- `identities`: who may do what in an S3 lake's store: one identity per component
  (`claw lake-secrets`), and the lake's bucket created with the admin's.
"""

from claw_pipelines.lake.delta import Lake

__all__ = ["Lake"]
