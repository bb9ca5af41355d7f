"""Many jobs on one cluster: the scheduler's decisions (policy), job traces (trace) and a
simulator of the policies on a fleet (simulate). Pure Python, no Ray: the scheduler actor that
carries the decisions out is a layer above."""
