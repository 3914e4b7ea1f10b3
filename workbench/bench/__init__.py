"""The benchmarks: one module per ``workbench bench`` command, and one writer of their output.

=========================  =====================================================================
module                     command, or role
=========================  =====================================================================
``packing``                ``workbench bench packing``: the packing algorithms at the paper's scale
``symmetric_contraction``  ``workbench bench symmetric-contraction``: products[0], every backend
``channelwise_tp``         ``workbench bench channelwise-tp``: interactions[1], every backend
``resources``              ``workbench kernels resources``: registers, spills, occupancy (PTX + ptxas)
``data``                   ``workbench bench data``: prepare, storage layout, training at 100k-1M graphs
``quality``                ``workbench bench quality``: validation errors against ``mace_run_train``;
                           ``quality_summary``: its verdicts and table
``cpu``                    ``workbench bench cpu``: MD and train steps on a CPU, e3nn against numba;
                           ``cpu_trajectory``: its Figure 9 check
``step``                   ``workbench bench step``: the whole train step on one device;
                           ``step_model``: the model and step it times; ``step_profile``: where
                           the step's time goes; ``step_modes``: fixed shapes and CUDA graphs
``train``                  ``workbench bench train``: one epoch per variant, baseline against packer
``cold_start``             ``workbench bench cold-start``: empty kernel cache to the first step
``table``                  the text tables and JSON files all of them write
``harness``                backend switching, timing, parity against e3nn
``workloads``              model configurations, and systems as mace batches
``cli``, ``kernel_cli``    the commands' options (no torch: the parser is built from them)
=========================  =====================================================================

Importing this package imports nothing else.
"""
