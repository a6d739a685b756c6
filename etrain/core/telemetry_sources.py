"""What a node's telemetry sources read: NVML on a GPU node, the host's memory on every node. Without Ray: the
node's telemetry actor (etrain/control/telemetry.py) holds them, and bench/gpu.py reads NVML with the same source.

A source is a class with `name` and `read(node) -> Reading | None` (None: nothing to read here, such as NVML on a
node without a GPU). Add one to SOURCES to plug in another (a BMC, a vendor's health daemon).
"""

from __future__ import annotations

import logging
import time

from etrain.core.health import Reading

logger = logging.getLogger(__name__)


class HostSource:
    name = "host"

    def read(self, node: str) -> Reading:
        import psutil

        memory, swap = psutil.virtual_memory(), psutil.swap_memory()
        return Reading(
            node,
            time.time(),
            self.name,
            mem_available=memory.available / memory.total,
            swap_used=swap.used / swap.total if swap.total else 0.0,
        )


class NvmlSource:
    """nvidia-ml-py: every GPU of the node, summed (counters) or at its worst (heat). Xid events through an event
    set, drained at each reading."""

    name = "nvml"

    def __init__(self):
        self.nvml, self.handles, self.events = None, [], None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.nvml = pynvml
        except Exception as e:  # no driver, no GPU, no library: nothing to read on this node
            logger.info("NVML unavailable here (%s): GPU telemetry off on this node", e)
            return
        try:
            self.events = pynvml.nvmlEventSetCreate()
            for h in self.handles:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.events)
        except pynvml.NVMLError as e:
            logger.warning("NVML Xid events unavailable (%s): Xids are not watched on this node", e)
            self.events = None

    def read(self, node: str) -> Reading | None:
        if self.nvml is None or not self.handles:
            return None
        n = self.nvml
        r = Reading(node, time.time(), self.name, xid=self._xids(), ecc_sbe=0, ecc_dbe=0, pcie_replays=0)
        temps, throttled, power = [], False, 0.0
        thermal = n.nvmlClocksEventReasonSwThermalSlowdown | n.nvmlClocksEventReasonHwThermalSlowdown
        for h in self.handles:
            ecc = n.nvmlDeviceGetTotalEccErrors
            r.ecc_sbe += self._try(ecc, h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC)
            r.ecc_dbe += self._try(ecc, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)
            r.pcie_replays += self._try(n.nvmlDeviceGetPcieReplayCounter, h)
            remap = self._try(n.nvmlDeviceGetRemappedRows, h, default=None)
            if remap is not None and remap[3]:  # (correctable, uncorrectable, pending, failure)
                r.remap_failure = True
            temps.append(self._try(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU))
            reasons = self._try(n.nvmlDeviceGetCurrentClocksEventReasons, h)
            throttled |= bool(reasons & thermal)
            power += self._try(n.nvmlDeviceGetPowerUsage, h) / 1000
        r.temperature_c, r.throttle_thermal, r.power_w = max(temps), throttled, power
        return r

    def _xids(self) -> list[int]:
        found = []
        while self.events is not None:
            try:
                found.append(int(self.nvml.nvmlEventSetWait(self.events, 0).eventData))
            except self.nvml.NVMLError:  # timeout: no more events
                return found
        return found

    def _try(self, fn, *args, default=0):
        """A counter this GPU does not offer (ECC off, no row remapping) reads as `default`."""
        try:
            return fn(*args)
        except self.nvml.NVMLError:
            return default


SOURCES = {"host": HostSource, "nvml": NvmlSource}
