"""scripts/plan.py's devices (logical CPUs, logical GPUs of the first GPU, a LocalCluster's workers) and peaks."""

from __future__ import annotations

from typing import Any

# Each logical GPU's share of the first GPU: the memory TensorFlow's allocator for it may take (MiB).
GPU_MEMORY_MIB = 8192


def logical_devices(n: int, device_type: str = "CPU") -> list[str]:
    """Split this process's CPU, or its first GPU, into ``n`` logical devices (before TensorFlow starts); name them."""
    import tensorflow as tf

    if device_type not in ("CPU", "GPU"):
        raise ValueError(f"device_type={device_type!r}: give 'CPU' or 'GPU'.")
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(f"device_type={device_type!r}: this machine has no {device_type}; give 'CPU'.")
    if device_type == "GPU":
        config = tf.config.LogicalDeviceConfiguration(memory_limit=GPU_MEMORY_MIB)
        tf.config.set_logical_device_configuration(physical[0], [config] * n)
    elif n > 1:
        tf.config.set_logical_device_configuration(physical[0], [tf.config.LogicalDeviceConfiguration()] * n)
    return names(n, device_type)


def names(n: int, device_type: str = "CPU") -> list[str]:
    """The names of the ``n`` logical devices ``logical_devices`` made (it can split a device only once)."""
    return [f"/{device_type}:{i}" for i in range(n)]


class LogicalPeak:
    """The peak bytes above the start of this process's logical devices, summed over their allocators.

    Logical CPUs share one BFC allocator (CPU:0 reads it); each logical GPU has its own, and the sum of their peaks
    is what a per-device budget bounds, as on a cluster's workers.
    """

    def __init__(self, n: int, device_type: str = "CPU"):
        self.devices = logical_devices(n, device_type)  # before TensorFlow makes any tensor
        self._names = [d.lstrip("/") for d in self.devices] if device_type == "GPU" else ["CPU:0"]
        self._base: list[int] = []

    def begin(self) -> None:
        import tensorflow as tf

        self._base = [tf.config.experimental.get_memory_info(name)["current"] for name in self._names]

    def reset(self) -> None:
        import tensorflow as tf

        for name in self._names:
            tf.config.experimental.reset_memory_stats(name)

    def read(self) -> tuple[float, None]:
        """(the peak bytes, None: no process of their own)."""
        import tensorflow as tf

        peaks = [tf.config.experimental.get_memory_info(name)["peak"] for name in self._names]
        return float(sum(p - b for p, b in zip(peaks, self._base))), None


class WorkerPeak:
    """The peak bytes of a fresh LocalCluster's workers' allocators (summed), and of their processes.

    The allocator's peak is what a budget bounds (as on a GPU); a worker's process holds more (its runtime, the
    buffers tensors cross in, pages the allocator touched): its resident high-water mark (VmHWM, reset before the
    measured steps with ``clear_refs``) above what it held idle, after an op had run on it.
    """

    def __init__(self, n: int):
        import tensorflow as tf

        import tfpipe

        self.cluster = tfpipe.cluster.LocalCluster(n).start()
        self.devices = self.cluster.devices
        for device in self.devices:
            with tf.device(device):
                tf.reduce_sum(tf.ones([8])).numpy()
        self._base: list[int] = []
        self._rss: list[int] = []

    def begin(self) -> None:
        self._base = [info["current"] for info in self.cluster.memory_info()]
        self._rss = [status_bytes(pid, "VmRSS") for pid in self.cluster.pids]

    def reset(self) -> None:
        self.cluster.reset_memory_stats()
        for pid in self.cluster.pids:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # the high-water mark starts again from the resident size

    def read(self) -> tuple[float, float]:
        """(the allocators' peak bytes, the processes' resident peak bytes), summed over the workers; stops them."""
        peaks = [info["peak"] for info in self.cluster.memory_info()]
        process = sum(status_bytes(pid, "VmHWM") - rss for pid, rss in zip(self.cluster.pids, self._rss))
        self.cluster.stop()
        return float(sum(p - b for p, b in zip(peaks, self._base))), float(process)


def peak_reader(config: dict[str, Any]) -> LogicalPeak | WorkerPeak:
    """The devices and the peak reader a configuration's spec asks for (--cluster, --device_type, --devices)."""
    if config.get("cluster"):
        return WorkerPeak(config["devices"])
    return LogicalPeak(config["devices"], config.get("device_type", "CPU"))


def status_bytes(pid: int, field: str) -> int:
    """A field of /proc/PID/status, in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no {field}.")
