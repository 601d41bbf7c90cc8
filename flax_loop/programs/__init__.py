r"""The step's programs: how the step a task describes (`flax_loop.step`) is
laid out over the devices (`sharding`), carried between calls (`state`,
`packing`), counted (`statistics`), lowered (`lowering`), compiled in the
variants a dispatch plan calls (`variants`, `compiled`) and kept once a
process (`cache`)."""
