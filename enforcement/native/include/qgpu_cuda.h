/* The subset of the CUDA driver API (cuda.h) that the interposer and the simulated driver
 * use, declared here so that no CUDA SDK is needed at build time. Layouts follow the public
 * driver ABI (CUDA 12.x, LP64). */
#ifndef QGPU_CUDA_H
#define QGPU_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUarray_st *CUarray;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUlinkState_st *CUlinkState;
typedef unsigned int CUdeviceptr_v1;
typedef int CUjit_option;     /* enum CUjit_option_enum */
typedef int CUjitInputType;   /* enum CUjitInputType_enum */
typedef int CUlibraryOption;  /* enum CUlibraryOption_enum */
typedef int CUmoduleLoadingMode; /* enum CUmoduleLoadingMode_enum */

#define CU_JIT_INPUT_CUBIN 0
#define CU_JIT_INPUT_PTX 1
#define CU_JIT_INPUT_FATBINARY 2
#define CU_JIT_INPUT_OBJECT 3
#define CU_JIT_INPUT_LIBRARY 4
#define CU_JIT_INPUT_NVVM 5
#define CU_MODULE_EAGER_LOADING 1
#define CU_MODULE_LAZY_LOADING 2

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_DEINITIALIZED 4
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_DEVICE_UNAVAILABLE 46
#define CUDA_ERROR_INVALID_IMAGE 200
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_NO_BINARY_FOR_GPU 209
#define CUDA_ERROR_INVALID_PTX 218
#define CUDA_ERROR_JIT_COMPILER_NOT_FOUND 221
#define CUDA_ERROR_FILE_NOT_FOUND 301
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_LAUNCH_FAILED 719
#define CUDA_ERROR_NOT_PERMITTED 800
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_UNSUPPORTED_LIMIT 215
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901
#define CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE 910
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_UNKNOWN 999

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

#define CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK 1
#define CU_DEVICE_ATTRIBUTE_WARP_SIZE 10
#define CU_DEVICE_ATTRIBUTE_COMPUTE_MODE 20
/* CUcomputemode (the same numbers as NVML's nvmlComputeMode_t) */
#define CU_COMPUTEMODE_DEFAULT 0
#define CU_COMPUTEMODE_PROHIBITED 2
#define CU_COMPUTEMODE_EXCLUSIVE_PROCESS 3
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_PCI_BUS_ID 33
#define CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID 34
#define CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID 50
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY 83
#define CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH 95
#define CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED 115

typedef enum {
    CU_ARRAY_FORMAT_UNSIGNED_INT8 = 0x01,
    CU_ARRAY_FORMAT_UNSIGNED_INT16 = 0x02,
    CU_ARRAY_FORMAT_UNSIGNED_INT32 = 0x03,
    CU_ARRAY_FORMAT_SIGNED_INT8 = 0x08,
    CU_ARRAY_FORMAT_SIGNED_INT16 = 0x09,
    CU_ARRAY_FORMAT_SIGNED_INT32 = 0x0a,
    CU_ARRAY_FORMAT_HALF = 0x10,
    CU_ARRAY_FORMAT_FLOAT = 0x20
} CUarray_format;

typedef struct {
    size_t Width;
    size_t Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

/* CUDA 2.0 (v1) descriptors: 32-bit sizes */
typedef struct {
    unsigned int Width;
    unsigned int Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR_v1;

typedef struct {
    unsigned int Width;
    unsigned int Height;
    unsigned int Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR_v1;

typedef struct {
    size_t Width;
    size_t Height;
    size_t Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

#define CU_MEM_LOCATION_TYPE_INVALID 0
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_LOCATION_TYPE_HOST 2
#define CU_MEM_LOCATION_TYPE_HOST_NUMA 3
#define CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT 4

typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

/* CUmemAllocationHandleType: what cuMemCreate may be asked to export to */
#define CU_MEM_HANDLE_TYPE_NONE 0x0
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define CU_MEM_HANDLE_TYPE_WIN32 0x2
#define CU_MEM_HANDLE_TYPE_WIN32_KMT 0x4
#define CU_MEM_HANDLE_TYPE_FABRIC 0x8
#define CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0x0
#define CU_MEM_ALLOC_GRANULARITY_RECOMMENDED 0x1

/* legacy IPC (cuIpcGetMemHandle): an opaque 64-byte handle passed by value */
#define CU_IPC_HANDLE_SIZE 64
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
typedef struct CUipcMemHandle_st {
    char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;

typedef struct {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

/* cuMemPoolExportPointer: an opaque 64-byte record passed by address */
typedef struct {
    unsigned char reserved[64];
} CUmemPoolPtrExportData;

/* managed memory (cuMemAllocManaged, cuMemPrefetchAsync, cuMemAdvise) */
#define CU_DEVICE_CPU ((CUdevice)-1)
#define CU_DEVICE_INVALID ((CUdevice)-2)
#define CU_MEM_ATTACH_GLOBAL 0x1
#define CU_MEM_ATTACH_HOST 0x2
#define CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS 89
#define CU_MEM_ADVISE_SET_READ_MOSTLY 1
#define CU_MEM_ADVISE_UNSET_READ_MOSTLY 2
#define CU_MEM_ADVISE_SET_PREFERRED_LOCATION 3
#define CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION 4
#define CU_MEM_ADVISE_SET_ACCESSED_BY 5
#define CU_MEM_ADVISE_UNSET_ACCESSED_BY 6
#define CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY 1
#define CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION 2
#define CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY 3
#define CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION 4
#define CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE 5
#define CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID 6
#define CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE 7
#define CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID 8

typedef struct {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr; /* out */
} CUDA_MEM_ALLOC_NODE_PARAMS;

typedef struct {
    void *execAffinityParams; /* CUexecAffinityParam* */
    int numExecAffinityParams;
    void *cigParams; /* CUctxCigParam* */
} CUctxCreateParams;

#define CU_DEV_RESOURCE_TYPE_SM 1
#define CU_GREEN_CTX_DEFAULT_STREAM 0x1
typedef struct {
    int type; /* CUdevResourceType */
    unsigned char _internal_padding[92];
    union {
        struct {
            unsigned int smCount, minSmPartitionSize, smCoscheduledAlignment;
        } sm;
        unsigned char _oversize[48];
    };
} CUdevResource;

typedef int CUfunction_attribute;
#define CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK 0
#define CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES 1
#define CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES 2
#define CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES 3
#define CU_FUNC_ATTRIBUTE_NUM_REGS 4
#define CU_FUNC_ATTRIBUTE_PTX_VERSION 5
#define CU_FUNC_ATTRIBUTE_BINARY_VERSION 6
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT 9

#define CU_LIMIT_STACK_SIZE 0
#define CU_LIMIT_PRINTF_FIFO_SIZE 1
#define CU_LIMIT_MALLOC_HEAP_SIZE 2
#define CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH 3
#define CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT 4

#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH 6
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT 7
#define CU_MEMPOOL_ATTR_USED_MEM_HIGH 8

#define CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT 0
#define CU_GRAPH_MEM_ATTR_USED_MEM_HIGH 1
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH 3

#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1

typedef struct CUlaunchAttribute_st {
    int id;
    char pad[4];
    char value[64];
} CUlaunchAttribute;

typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef struct {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
} CUDA_KERNEL_NODE_PARAMS;

typedef struct {
    CUfunction function;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;

typedef struct {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
    void *kern; /* CUkernel */
    CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS_v2;

/* cuGraphAddNode(_v2)'s generic node parameters (CUDA 12.2+): the node types below read
 * their member of the union; the union is 29 long longs wide. */
#define CU_GRAPH_NODE_TYPE_KERNEL 0
#define CU_GRAPH_NODE_TYPE_GRAPH 4
#define CU_GRAPH_NODE_TYPE_EMPTY 5
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define CU_GRAPH_NODE_TYPE_MEM_FREE 11
#define CU_GRAPH_NODE_TYPE_CONDITIONAL 13

/* CUgraphChildGraphNodeOwnership (CUDA 12.9+) */
#define CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE 0
#define CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE 1

typedef struct {
    CUgraph graph;
    int ownership; /* CUgraphChildGraphNodeOwnership */
} CUDA_CHILD_GRAPH_NODE_PARAMS;

typedef cuuint64_t CUgraphConditionalHandle;
#define CU_GRAPH_COND_TYPE_IF 0
#define CU_GRAPH_COND_TYPE_WHILE 1
#define CU_GRAPH_COND_TYPE_SWITCH 2
#define CU_GRAPH_COND_ASSIGN_DEFAULT 1

typedef struct {
    CUgraphConditionalHandle handle;
    int type; /* CUgraphConditionalNodeType */
    unsigned int size;
    CUgraph *phGraph_out; /* out: the node's body graphs, owned by the driver */
    CUcontext ctx;
} CUDA_CONDITIONAL_NODE_PARAMS;

typedef struct {
    int type; /* CUgraphNodeType */
    int reserved0[3];
    union {
        long long reserved1[29];
        CUDA_KERNEL_NODE_PARAMS_v2 kernel; /* the v3 layout is the same */
        CUDA_CHILD_GRAPH_NODE_PARAMS graph;
        CUDA_MEM_ALLOC_NODE_PARAMS alloc;   /* the v2 layout is the same */
        CUdeviceptr free_dptr;              /* CUDA_MEM_FREE_NODE_PARAMS */
        CUDA_CONDITIONAL_NODE_PARAMS conditional;
    };
    long long reserved2;
} CUgraphNodeParams;

/* cuGraphExecUpdate (v1: result and error node as out parameters; _v2: this struct) */
#define CU_GRAPH_EXEC_UPDATE_SUCCESS 0
#define CU_GRAPH_EXEC_UPDATE_ERROR 1
#define CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED 2
#define CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED 3
#define CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED 5
#define CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED 6
typedef struct {
    int result; /* CUgraphExecUpdateResult */
    CUgraphNode errorNode;
    CUgraphNode errorFromNode;
} CUgraphExecUpdateResultInfo;

/* CUgraphInstantiate_flags */
#define CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH 1ULL
#define CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD 2ULL
#define CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH 4ULL
#define CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY 8ULL

typedef struct CUgraphEdgeData_st CUgraphEdgeData;

#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2

typedef enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
} CUdriverProcAddressQueryResult;

#define CU_EVENT_DEFAULT 0
#define CU_EVENT_DISABLE_TIMING 2

/* the checkpoint API (cuCheckpointProcess*, CUDA 12.8): as cuda.h lays the types out */
typedef enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3
} CUprocessState;
typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs;
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;
typedef struct CUcheckpointCheckpointArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;
typedef struct CUcheckpointGpuPair_st {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;
typedef struct CUcheckpointRestoreArgs_st {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct CUcheckpointUnlockArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

#endif
