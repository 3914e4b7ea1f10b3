"""Plotly figures and ipywidgets apps used by the notebooks; every view is a function tests can call.

>>> from workbench import viz
>>> viz.dataset_figure(sizes)                       # Table 3 / Figure 5: families and graph sizes
>>> viz.family_gallery(structures)                  # nglview, one structure per family
>>> viz.bin_layout_app(sizes, num_replicas=8)       # Figure 12: graphs per GPU, step slider
>>> viz.capacity_app(synthetic_sizes(2_650_000))    # capacity x GPUs x algorithm, precomputed grid
>>> viz.kernel_app()                                # benchmarks/results/*.json: bars and roofline
>>> viz.gpu_pass_figure(); viz.gpu_missing_rows()   # numba / cueq / e3nn on a GPU, and what was not measured
>>> viz.scaling_figure(viz.project_scaling(big))    # Figures 7, 8, 10 kind, a projection
>>> viz.run_monitor(run)                            # launcher panel + live loss and step times
>>> viz.md_energy_figure(run_md(model, atoms))      # NVE energy against time of a trained model

Importing this package applies the nglview 4.0.1 frontend-version fix
(:func:`workbench.viz.molecules.fix_nglview_frontend`) before anything imports
nglview; plotly, ipywidgets and nglview themselves are imported only when a
view is built.
"""

from workbench.viz.molecules import fix_nglview_frontend

fix_nglview_frontend()

from workbench.viz.capacity import CapacityStudy, capacity_app, capacity_curves_figure
from workbench.viz.dataset import dataset_figure, distribution_stats, family_table_html
from workbench.viz.gpu_figures import gpu_pass_figure, gpu_profile_figure, gpu_step_figure
from workbench.viz.gpu_results import (
    format_gpu_table,
    gpu_missing_rows,
    gpu_pass_rows,
    gpu_results_table,
    gpu_sources,
    gpu_step_rows,
)
from workbench.viz.kernels import kernel_app, kernel_timings_figure, read_kernel_results, roofline_figure
from workbench.viz.layout import (
    Rectangles,
    bin_layout_app,
    bin_layout_figure,
    layout_rectangles,
    rectangles_from_batches,
)
from workbench.viz.md import md_energy_figure
from workbench.viz.molecules import family_gallery, molecule_browser, molecule_view
from workbench.viz.monitor import RunMonitor, loss_figure, run_monitor, step_series, step_time_figure
from workbench.viz.paths import runs_dir
from workbench.viz.scaling import (
    AllReduceModel,
    KernelSpeedup,
    kernel_speedup_from_results,
    project_scaling,
    projection_cost_model,
    scaling_assumptions,
    scaling_figure,
    simulate_epoch,
)
from workbench.viz.style import FAMILY_COLORS, family_color

__all__ = [
    "FAMILY_COLORS",
    "AllReduceModel",
    "CapacityStudy",
    "KernelSpeedup",
    "Rectangles",
    "RunMonitor",
    "bin_layout_app",
    "bin_layout_figure",
    "capacity_app",
    "capacity_curves_figure",
    "dataset_figure",
    "distribution_stats",
    "family_color",
    "family_gallery",
    "family_table_html",
    "fix_nglview_frontend",
    "format_gpu_table",
    "gpu_missing_rows",
    "gpu_pass_figure",
    "gpu_pass_rows",
    "gpu_profile_figure",
    "gpu_results_table",
    "gpu_sources",
    "gpu_step_figure",
    "gpu_step_rows",
    "kernel_app",
    "kernel_speedup_from_results",
    "kernel_timings_figure",
    "layout_rectangles",
    "loss_figure",
    "md_energy_figure",
    "molecule_browser",
    "molecule_view",
    "project_scaling",
    "projection_cost_model",
    "read_kernel_results",
    "rectangles_from_batches",
    "roofline_figure",
    "run_monitor",
    "runs_dir",
    "scaling_assumptions",
    "scaling_figure",
    "simulate_epoch",
    "step_series",
    "step_time_figure",
]
