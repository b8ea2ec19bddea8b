"""Pure transforms: frames in, frames out. No lake paths, no Dagster, no servers.

- `steps`, `stitching`: bronze records into silver steps; unscoped calls stitched into
  trajectories by token prefixes;
- `fragments`: where a trajectory's history stops extending itself (context compaction), and
  why;
- `partials`: aborted generations joined with their continuation into one step (partial
  rollouts), and the policy version of each response token;
- `contexts`: a prompt stored relative to an earlier step (its new tokens only), and every
  prompt decoded back whole, vectorized;
- `feedback`, `trajectories`: reward and feedback facts resolved; trajectories' states;
- `curation`: a spec's rules over candidate steps (kept, rejected and why, advantages);
- `judges`: which judge's facts resolve a step's reward;
- `prefix_tree`, `packing`: steps merged into prefix trees, packed for training;
- `hashing`: content hashes of token ids;
- `quality`: data-quality findings over silver and gold (what the checks report).
"""
