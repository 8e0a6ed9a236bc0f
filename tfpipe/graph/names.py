"""The names a step gives its tasks' ops and its traced functions, so that tfpipe.analysis can read a graph back."""

TASK_START = "task_start"  # the name of the no-op that opens each task's name scope
TASK_END = "task_end"  # the op that reads everything a task produced: the device's next task waits for it
# The name of the functions that recompute a cell and take its VJP in one call (tfpipe/backward/remat.py).
TRACED_VJP = "tfpipe_recompute_vjp"
SPLIT_FORWARD = "tfpipe_split_forward"  # a cell's forward cut from its split VJP (zero bubble, kept activations)
GRADIENT_SUM = "tfpipe_sum_gradients"  # the function that adds a task's weight gradients to the running sums
LOSS_FUNCTION = "tfpipe_loss"  # the function of a micro-batch's loss and its gradients (tfpipe/step/loss.py)
