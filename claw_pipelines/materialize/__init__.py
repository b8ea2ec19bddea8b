"""Building silver and gold: the incremental transforms the Dagster assets, `claw
materialize` and the live materializer all run (docs/DESIGN.md §9-§12).

- `silver`: a silver run: what bronze gained, normalized into steps, facts, rewards and
  trajectories, exactly once under overlapping writers;
- `silver_view`: what a follower keeps of silver between runs (an increment costs what
  changed);
- `gold`: one (dataset, policy version) partition built whole: curate, merge into prefix
  trees, write with lineage;
- `increments`: a dataset brought up to date with silver, rewriting only what changed;
- `live`: the live materializer (`claw materialize --follow`): rounds of silver and gold
  seconds after bronze;
- `rescore`: stored steps scored again by a versioned judge;
- `failing`: the builds that keep failing, as their builders report them.
"""
