"""Oobleck (Jang et al., SOSP'23): pipeline templates, heterogeneous pipeline instantiation, batch distribution and
in-place reconfiguration.

costs        stage time and memory per layer range, from a ModelProfile
mapping      GPU-to-stage mapping: the memoised dynamic program of Section 4.1.2
templates    node specification (4.1.1) and the template set of a job
instantiate  how many pipelines of each template (4.2), one integer program
batch        micro-batches per pipeline (Eq. 6)
reconfigure  new pipelines and layer copies after failures or joins (5.1)
to_plan      pipelines to a runtime Plan
"""
