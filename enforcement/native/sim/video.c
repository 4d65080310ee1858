/* Video engines, as far as NVML shows them: a process's encoder (NVENC) and frame-buffer
 * capture (NvFBC) sessions. On NVIDIA's stack those are opened through the Video Codec and
 * Capture SDKs' own libraries, which the simulator has not; `qgpuSimVideoSessionOpen` stands
 * in for them (a simulator-only entry point, named so that no CUDA program calls it by
 * accident). A session is counted in the process's slot of the GPU's shared state, with the
 * frame rate and latency NVML then reports for it, and closes when the process ends; NVML's
 * session lists and statistics (nvml.c) read them for every process, as NVIDIA's do. */
#include "driver.h"

enum { SIM_VIDEO_ENCODER = 0, SIM_VIDEO_FBC = 1 };

SIM_EXPORT CUresult qgpuSimVideoSessionOpen(CUdevice dev, unsigned int kind, unsigned int fps,
                                            unsigned int latency_us) {
    int gidx;
    CUresult r = sim_device_gidx(dev, &gidx);
    if (r) return r;
    if (kind != SIM_VIDEO_ENCODER && kind != SIM_VIDEO_FBC) return CUDA_ERROR_INVALID_VALUE;
    sim_gpu_state_t *st = g_sim_state[gidx];
    sim_state_lock(st);
    sim_proc_t *p = sim_state_proc_slot(st, 1);
    if (p && kind == SIM_VIDEO_ENCODER) {
        p->enc_sessions++;
        p->enc_fps = fps;
        p->enc_latency_us = latency_us;
    } else if (p) {
        p->fbc_sessions++;
    }
    sim_state_unlock(st);
    return p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY; /* no process slot left */
}
