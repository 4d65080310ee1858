/* NVML's ABI as nvml.h defines it (NVIDIA's header is not installed here; the layouts follow
 * nvml.h and nvidia-ml-py's ctypes mirrors, and are pinned below by size and offset): return
 * codes, struct versions and the structs the simulated NVML serves and the interposer filters.
 * Shared by both, so they cannot disagree. nvmlDevice_t is left to each (the interposer's is
 * opaque, the simulator's is its own device record). */
#ifndef QGPU_NVML_H
#define QGPU_NVML_H

#include <stddef.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu
#define NVML_FEATURE_DISABLED 0
#define NVML_FEATURE_ENABLED 1

/* NVML_STRUCT_VERSION(data, ver): the struct's size with the version in the top byte */
#define QGPU_NVML_STRUCT_VERSION(type, ver) ((unsigned int)(sizeof(type) | ((ver) << 24U)))

/* nvmlProcessMode_t */
enum { NVML_PROCESS_MODE_COMPUTE = 0, NVML_PROCESS_MODE_GRAPHICS = 1, NVML_PROCESS_MODE_MPS = 2 };

/* nvmlSamplingType_t */
enum {
    NVML_TOTAL_POWER_SAMPLES = 0,
    NVML_GPU_UTILIZATION_SAMPLES = 1,
    NVML_MEMORY_UTILIZATION_SAMPLES = 2,
    NVML_ENC_UTILIZATION_SAMPLES = 3,
    NVML_DEC_UTILIZATION_SAMPLES = 4,
    NVML_PROCESSOR_CLK_SAMPLES = 5,
    NVML_MEMORY_CLK_SAMPLES = 6,
    NVML_MODULE_POWER_SAMPLES = 7,
    NVML_JPG_UTILIZATION_SAMPLES = 8,
    NVML_OFA_UTILIZATION_SAMPLES = 9,
    NVML_SAMPLINGTYPE_COUNT = 10
};

/* nvmlValueType_t */
enum { NVML_VALUE_TYPE_DOUBLE = 0, NVML_VALUE_TYPE_UNSIGNED_INT = 1 };

typedef struct {
    unsigned long long total, free, used; /* used: reserved + allocated */
} nvmlMemory_t;

typedef struct {
    unsigned int version; /* nvmlMemory_v2 */
    unsigned long long total, reserved, free, used; /* used: allocated only */
} nvmlMemory_v2_t;
#define nvmlMemory_v2 QGPU_NVML_STRUCT_VERSION(nvmlMemory_v2_t, 2)

typedef struct {
    unsigned long long bar1Total, bar1Free, bar1Used;
} nvmlBAR1Memory_t;

typedef struct {
    unsigned int gpu, memory; /* percent of the last sample period */
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId; /* 0xFFFFFFFF without MIG */
} nvmlProcessInfo_t; /* v2 and v3 */

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;

typedef struct {
    unsigned int version; /* nvmlProcessDetailList_v1 */
    unsigned int mode;    /* NVML_PROCESS_MODE_* */
    unsigned int numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_t;
#define nvmlProcessDetailList_v1 QGPU_NVML_STRUCT_VERSION(nvmlProcessDetailList_t, 1)

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU time, microseconds since the epoch */
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned long long timeStamp; /* first here, unlike the sample above */
    unsigned int pid;
    unsigned int smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;

typedef struct {
    unsigned int version; /* nvmlProcessesUtilizationInfo_v1 */
    unsigned int processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_t;
#define nvmlProcessesUtilizationInfo_v1 QGPU_NVML_STRUCT_VERSION(nvmlProcessesUtilizationInfo_t, 1)

typedef union {
    double dVal;
    int siVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned long long timeStamp; /* CPU time, microseconds since the epoch */
    nvmlValue_t sampleValue;
} nvmlSample_t;

typedef struct {
    unsigned int gpuUtilization;    /* percent of the process's life a kernel of it ran */
    unsigned int memoryUtilization; /* percent of its life its memory was read or written */
    unsigned long long maxMemoryUsage;
    unsigned long long time;      /* ms its context was active; 0 while it runs */
    unsigned long long startTime; /* CPU time, microseconds since the epoch */
    unsigned int isRunning;
    unsigned int reserved[5];
} nvmlAccountingStats_t;

typedef struct {
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount,
        computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int sessionId, pid, vgpuInstance, codecType, hResolution, vResolution, averageFps,
        averageLatency;
} nvmlEncoderSessionInfo_t;

typedef struct {
    unsigned int sessionsCount, averageFPS, averageLatency;
} nvmlFBCStats_t;

typedef struct {
    unsigned int sessionId, pid, vgpuInstance, displayOrdinal, sessionType, sessionFlags,
        hMaxResolution, vMaxResolution, hResolution, vResolution, averageFPS, averageLatency;
} nvmlFBCSessionInfo_t;

/* nvml.h's layouts on LP64 (what nvidia-ml-py's ctypes structs give too) */
_Static_assert(sizeof(nvmlMemory_v2_t) == 40 && nvmlMemory_v2 == 0x02000028u, "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlBAR1Memory_t) == 24, "nvmlBAR1Memory_t");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16 && sizeof(nvmlProcessInfo_t) == 24,
               "nvmlProcessInfo");
_Static_assert(sizeof(nvmlProcessDetail_v1_t) == 32, "nvmlProcessDetail_v1_t");
_Static_assert(sizeof(nvmlProcessDetailList_t) == 24 && nvmlProcessDetailList_v1 == 0x01000018u,
               "nvmlProcessDetailList_v1_t");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t");
_Static_assert(sizeof(nvmlProcessUtilizationInfo_v1_t) == 40 &&
                   offsetof(nvmlProcessUtilizationInfo_v1_t, pid) == 8,
               "nvmlProcessUtilizationInfo_v1_t");
_Static_assert(sizeof(nvmlProcessesUtilizationInfo_t) == 24 &&
                   nvmlProcessesUtilizationInfo_v1 == 0x01000018u,
               "nvmlProcessesUtilizationInfo_v1_t");
_Static_assert(sizeof(nvmlSample_t) == 16, "nvmlSample_t");
_Static_assert(sizeof(nvmlEncoderSessionInfo_t) == 32 && offsetof(nvmlEncoderSessionInfo_t, pid) == 4,
               "nvmlEncoderSessionInfo_t");
_Static_assert(sizeof(nvmlFBCStats_t) == 12, "nvmlFBCStats_t");
_Static_assert(sizeof(nvmlFBCSessionInfo_t) == 48 && offsetof(nvmlFBCSessionInfo_t, pid) == 4,
               "nvmlFBCSessionInfo_t");
_Static_assert(sizeof(nvmlAccountingStats_t) == 56 && offsetof(nvmlAccountingStats_t, isRunning) == 32,
               "nvmlAccountingStats_t");

#endif
