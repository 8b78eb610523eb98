/* loopkern's XLA FFI shim: launch a Numba-compiled cooperative megakernel on XLA's stream.
 *
 * Built with cffi on first use (see xla_ffi.py). libcuda is resolved with dlopen at run time,
 * so this builds on machines without a GPU or a driver; only the XLA FFI header is needed.
 *
 * Kernels are named by a small integer, not by a CUfunction: Python registers each cubin once
 * (lk_register_image copies it into a process-lifetime table) and puts its id in the custom
 * call's attribute "kernel". A CUfunction belongs to one context, and under jax.shard_map (or
 * one compiled call run on several GPUs) the same custom call, attributes and all, runs on
 * every device, each on its own stream. So the handler asks the driver for the context of the
 * stream XLA hands it (cuStreamGetCtx) and loads the image into that context the first time it
 * sees the pair (id, context): once per kernel and device. The functions it loaded are kept in
 * a table guarded by one mutex (XLA runs the calls of different devices on threads of its own,
 * concurrently), and never unloaded. For a cooperative launch it also keeps how many blocks of
 * the function can be co-resident on that device (an occupancy query, per block size): the
 * grid was sized on the GPU that was current when the call was built, and a mesh of unlike
 * GPUs must fail with that said, not with CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE.
 *
 * The kernel's parameters are all arrays here (scalars and the step count arrive as 1-element
 * buffers), passed in Numba's array ABI: for each array, 5 + 2*ndim 8-byte parameters
 * (meminfo, parent, nitems, itemsize, data, shape[ndim], strides[ndim] in bytes, row-major).
 * The attribute "layout" lists, for every kernel parameter in order, where its buffer is and
 * how to view it, five numbers each: (0, i, v, off, len) for the i-th argument or
 * (1, i, v, off, len) for the i-th result; v > 0 views the buffer as elements of v bytes
 * (scratch buffers are bytes or words to XLA, since JAX without x64 has no 64-bit types),
 * v == 0 keeps its own dtype; off > 0 or len > 0 (1-D buffers only) passes the part of the
 * buffer that starts off bytes in, len elements long (0: to the end), so that several
 * kernel parameters can share one buffer.
 *
 * Before the launch the handler zeroes the result "control" (a whole number of 32-bit
 * words: the run's control block, and the grid barrier's counter, which must start with its
 * low 31 bits clear) and writes "timeout_ns" into its int64 slot "timeout_slot" (the words
 * that are not zero, one cuMemsetD32Async each), all on XLA's stream. So XLA needs no op
 * of its own to initialise them, and no aliased input that it would have to copy or fill.
 * After the launch, if "count" names a result (an int32 scalar; -1: none), the low 32 bits
 * of the int64 slot "steps_slot" (the steps done) are copied into it (cuMemcpyDtoDAsync).
 *
 * The kernel reads and writes the arrays in their results, which the attribute "aliases" (pairs
 * of input, result) names as aliases of their inputs. XLA does not always hand the handler one
 * buffer for both: inside JAX's sequential vmap (a loop over the batch), XLA's GPU backend wraps
 * the custom call in a dynamic-slice fusion that passes a slice of the batch as the input and a
 * separate buffer as the result (seen on an H100, session 29). So before the launch each result
 * that is not its input's buffer gets the input's bytes (cuMemcpyDtoDAsync); with
 * LOOPKERN_FFI_TRACE set, the handler says so on stderr.
 *
 * Why memsets and not one cuMemcpyHtoDAsync of a host array: the driver API documents that
 * an async copy from pageable memory "might be synchronous with respect to host" and that
 * "if pageable memory must first be staged to pinned memory, the driver may synchronize
 * with the stream" (API synchronization behavior); memsets of device memory are
 * asynchronous, and carry their value in the call.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;
typedef unsigned long long CUdeviceptr;

#define LK_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDeviceGet)(CUdevice*, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
static CUresult (*p_cuCtxPushCurrent)(CUcontext);
static CUresult (*p_cuCtxPopCurrent)(CUcontext*);
static CUresult (*p_cuCtxGetDevice)(CUdevice*);
static CUresult (*p_cuDeviceGetAttribute)(int*, int, CUdevice);
static CUresult (*p_cuStreamGetCtx)(CUstream, CUcontext*);
static CUresult (*p_cuModuleLoadData)(CUmodule*, const void*);
static CUresult (*p_cuModuleUnload)(CUmodule);
static CUresult (*p_cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
static CUresult (*p_cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
static CUresult (*p_cuLaunchCooperativeKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                               unsigned, unsigned, CUstream, void**);
static CUresult (*p_cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void**, void**);
static CUresult (*p_cuGetErrorName)(CUresult, const char**);
static CUresult (*p_cuMemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
static CUresult (*p_cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*p_cuFuncSetAttribute)(CUfunction, int, int);
static CUresult (*p_cuFuncGetAttribute)(int*, int, CUfunction);
static CUresult (*p_cuCtxGetCurrent)(CUcontext*);

#define LK_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK 0
#define LK_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define LK_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define LK_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR 81
#define LK_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN 97
#define LK_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES 1

/* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: a kernel must opt in to more than the 48 KiB
   of dynamic shared memory every launch may have */
#define LK_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define LK_DEFAULT_SHARED (48 * 1024)

/* Resolved once (pthread_once): the handler may first run on several XLA threads at the same
   time, one per device. A failure is kept and reported on every call. */
static pthread_once_t lk_resolve_once = PTHREAD_ONCE_INIT;
static char lk_resolve_error[256];

static void lk_resolve_all(void) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    snprintf(lk_resolve_error, sizeof lk_resolve_error, "loopkern: cannot load libcuda (%s)", dlerror());
    return;
  }
#define LK_SYM(var, name)                                                                        \
  *(void**)(&var) = dlsym(h, name);                                                              \
  if (!var) {                                                                                    \
    snprintf(lk_resolve_error, sizeof lk_resolve_error, "loopkern: libcuda has no symbol %s", name); \
    return;                                                                                      \
  }
  LK_SYM(p_cuGetErrorName, "cuGetErrorName")
  LK_SYM(p_cuInit, "cuInit")
  LK_SYM(p_cuDeviceGet, "cuDeviceGet")
  LK_SYM(p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
  LK_SYM(p_cuCtxPushCurrent, "cuCtxPushCurrent_v2")
  LK_SYM(p_cuCtxPopCurrent, "cuCtxPopCurrent_v2")
  LK_SYM(p_cuCtxGetDevice, "cuCtxGetDevice")
  LK_SYM(p_cuDeviceGetAttribute, "cuDeviceGetAttribute")
  /* not cuStreamGetCtx_v2: that one (CUDA 12.5) takes a third parameter, the green context */
  LK_SYM(p_cuStreamGetCtx, "cuStreamGetCtx")
  LK_SYM(p_cuModuleLoadData, "cuModuleLoadData")
  LK_SYM(p_cuModuleUnload, "cuModuleUnload")
  LK_SYM(p_cuModuleGetFunction, "cuModuleGetFunction")
  LK_SYM(p_cuOccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
  LK_SYM(p_cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel")
  LK_SYM(p_cuLaunchKernel, "cuLaunchKernel")
  LK_SYM(p_cuMemsetD32Async, "cuMemsetD32Async")
  LK_SYM(p_cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2")
  LK_SYM(p_cuFuncSetAttribute, "cuFuncSetAttribute")
  LK_SYM(p_cuFuncGetAttribute, "cuFuncGetAttribute")
  LK_SYM(p_cuCtxGetCurrent, "cuCtxGetCurrent")
#undef LK_SYM
}

static int lk_resolve(char* err, size_t errlen) {
  pthread_once(&lk_resolve_once, lk_resolve_all);
  if (lk_resolve_error[0]) {
    snprintf(err, errlen, "%s", lk_resolve_error);
    return -1;
  }
  return 0;
}

static const char* lk_error_name(CUresult r) {
  const char* name = NULL;
  if (p_cuGetErrorName) p_cuGetErrorName(r, &name);
  return name ? name : "unknown";
}

static void lk_cuda_error(const char* what, CUresult r, char* err, size_t errlen) {
  snprintf(err, errlen, "loopkern: %s failed: %s (%d)", what, lk_error_name(r), r);
}

/* ------------------------------------------------------------------ the kernel images
 * Registered images, by id - 1. Process-lifetime: an id may be in any custom call XLA has
 * compiled in this process, so an image is never removed. Ids are process-local: the
 * attribute holds the id that the trace of this process registered. */
typedef struct {
  void* image;
  size_t len;
  char* entry;
} lk_image;

/* A function loaded into one context: the pair (id, ctx) is its key. For the cooperative
   launch check it keeps the device's SM count and, per block size and dynamic shared memory
   seen (up to LK_OCC of them; more are queried at every launch), the blocks one SM can hold;
   and the dynamic shared memory it has been allowed beyond the default. */
#define LK_OCC 8
typedef struct lk_loaded {
  int64_t id;
  CUcontext ctx;
  CUfunction f;
  CUdevice dev;
  int sms;
  int nocc;
  int occ_threads[LK_OCC];
  int64_t occ_shared[LK_OCC];
  int occ_blocks[LK_OCC];
  int64_t shared_allowed;
  struct lk_loaded* next;
} lk_loaded;

#define LK_BUCKETS 256
/* guards the images and the loaded functions; held across a load (once per kernel and
   device), so that two threads never load the same pair twice */
static pthread_mutex_t lk_mutex = PTHREAD_MUTEX_INITIALIZER;
static lk_image* lk_images = NULL;
static int64_t lk_nimages = 0, lk_images_cap = 0;
static lk_loaded* lk_table[LK_BUCKETS];

/* Register a kernel image (a cubin, ``len`` bytes) and its entry point; *id gets its id (>= 1).
   The bytes and the name are copied. Registering the same image and entry again gives the
   same id. */
int lk_register_image(const void* image, size_t len, const char* entry, int64_t* id, char* err, size_t errlen) {
  int rc = 0;
  pthread_mutex_lock(&lk_mutex);
  for (int64_t i = 0; i < lk_nimages; ++i) {
    lk_image* im = &lk_images[i];
    if (im->len == len && !memcmp(im->image, image, len) && !strcmp(im->entry, entry)) {
      *id = i + 1;
      goto done;
    }
  }
  if (lk_nimages == lk_images_cap) {
    int64_t cap = lk_images_cap ? 2 * lk_images_cap : 16;
    lk_image* grown = (lk_image*)realloc(lk_images, (size_t)cap * sizeof *grown);
    if (!grown) goto oom;
    lk_images = grown;
    lk_images_cap = cap;
  }
  {
    size_t elen = strlen(entry) + 1;
    void* copy = malloc(len ? len : 1);
    char* name = (char*)malloc(elen);
    if (!copy || !name) {
      free(copy);
      free(name);
      goto oom;
    }
    memcpy(copy, image, len);
    memcpy(name, entry, elen);
    lk_images[lk_nimages].image = copy;
    lk_images[lk_nimages].len = len;
    lk_images[lk_nimages].entry = name;
    *id = ++lk_nimages;
  }
  goto done;
oom:
  snprintf(err, errlen, "loopkern: out of memory registering a kernel image of %zu bytes", len);
  rc = -1;
done:
  pthread_mutex_unlock(&lk_mutex);
  return rc;
}

static size_t lk_bucket(int64_t id, CUcontext ctx) {
  uint64_t h = ((uint64_t)(uintptr_t)ctx >> 4) ^ ((uint64_t)id * 0x9E3779B97F4A7C15ull);
  return (size_t)((h ^ (h >> 29)) % LK_BUCKETS);
}

/* The function of image ``id`` in context ``ctx``, loaded on the first call for the pair.
   Call with lk_mutex held. ``where`` names the device for the error message. */
static lk_loaded* lk_function(int64_t id, CUcontext ctx, const char* where, char* err, size_t errlen) {
  size_t b = lk_bucket(id, ctx);
  for (lk_loaded* l = lk_table[b]; l; l = l->next)
    if (l->id == id && l->ctx == ctx) return l;
  if (id < 1 || id > lk_nimages) {
    snprintf(err, errlen, "loopkern: kernel %lld is not registered in this process (the custom call's attribute "
             "\"kernel\" must come from kernel.jax in the same process)", (long long)id);
    return NULL;
  }
  lk_loaded* l = (lk_loaded*)calloc(1, sizeof *l);
  if (!l) {
    snprintf(err, errlen, "loopkern: out of memory loading kernel %lld", (long long)id);
    return NULL;
  }
  const lk_image* im = &lk_images[id - 1];
  CUcontext popped;
  CUmodule mod = NULL;
  const char* step = "cuCtxPushCurrent";
  CUresult r = p_cuCtxPushCurrent(ctx);
  if (!r) {
    step = "cuModuleLoadData";
    r = p_cuModuleLoadData(&mod, im->image);
    if (!r) { step = "cuModuleGetFunction"; r = p_cuModuleGetFunction(&l->f, mod, im->entry); }
    if (!r) { step = "cuCtxGetDevice"; r = p_cuCtxGetDevice(&l->dev); }
    if (!r) {
      step = "cuDeviceGetAttribute";
      r = p_cuDeviceGetAttribute(&l->sms, LK_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, l->dev);
    }
    if (r && mod) p_cuModuleUnload(mod);
    p_cuCtxPopCurrent(&popped);
  }
  if (r) {
    snprintf(err, errlen, "loopkern: loading kernel %lld on %s failed: %s (%d) from %s", (long long)id, where,
             lk_error_name(r), r, step);
    free(l);
    return NULL;
  }
  l->id = id;
  l->ctx = ctx;
  l->next = lk_table[b];
  lk_table[b] = l;
  return l;
}

/* Let l's function launch with ``shared`` bytes of dynamic shared memory (beyond the default
   48 KiB a function must opt in, once per size). Call with lk_mutex held. */
static int lk_allow_shared(lk_loaded* l, int64_t shared, char* err, size_t errlen) {
  if (shared <= LK_DEFAULT_SHARED || shared <= l->shared_allowed) return 0;
  CUcontext popped;
  CUresult r = p_cuCtxPushCurrent(l->ctx);
  if (!r) {
    r = p_cuFuncSetAttribute(l->f, LK_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)shared);
    p_cuCtxPopCurrent(&popped);
  }
  if (r) {
    snprintf(err, errlen, "loopkern: kernel %lld on device %d cannot have %lld bytes of shared memory "
             "(cuFuncSetAttribute: %s (%d))", (long long)l->id, (int)l->dev, (long long)shared,
             lk_error_name(r), r);
    return -1;
  }
  l->shared_allowed = shared;
  return 0;
}

/* How many blocks of ``threads`` threads of l's function, each with ``shared`` bytes of dynamic
   shared memory, can be co-resident on its device (for a cooperative launch: all of them must
   be). Call with lk_mutex held. */
static int lk_coresident(lk_loaded* l, int64_t threads, int64_t shared, int64_t* limit, char* err, size_t errlen) {
  for (int k = 0; k < l->nocc; ++k)
    if (l->occ_threads[k] == threads && l->occ_shared[k] == shared) {
      *limit = (int64_t)l->occ_blocks[k] * l->sms;
      return 0;
    }
  int per_sm = 0;
  CUcontext popped;
  CUresult r = p_cuCtxPushCurrent(l->ctx);
  if (!r) {
    r = p_cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, l->f, (int)threads, (size_t)shared);
    p_cuCtxPopCurrent(&popped);
  }
  if (r) {
    snprintf(err, errlen, "loopkern: the occupancy query for kernel %lld on device %d failed: %s (%d)",
             (long long)l->id, (int)l->dev, lk_error_name(r), r);
    return -1;
  }
  if (l->nocc < LK_OCC) {
    l->occ_threads[l->nocc] = (int)threads;
    l->occ_shared[l->nocc] = shared;
    l->occ_blocks[l->nocc++] = per_sm;
  }
  *limit = (int64_t)per_sm * l->sms;
  return 0;
}

/* Device ``device``'s primary context (the one JAX uses), retained, and ``where``, the
   device's name for error messages. */
static int lk_primary_context(int device, CUcontext* ctx, char* where, size_t wherelen, char* err,
                              size_t errlen) {
  if (lk_resolve(err, errlen)) return -1;
  CUresult r;
  CUdevice dev;
  if ((r = p_cuInit(0))) { lk_cuda_error("cuInit", r, err, errlen); return -1; }
  if ((r = p_cuDeviceGet(&dev, device))) { lk_cuda_error("cuDeviceGet", r, err, errlen); return -1; }
  if ((r = p_cuDevicePrimaryCtxRetain(ctx, dev))) { lk_cuda_error("cuDevicePrimaryCtxRetain", r, err, errlen); return -1; }
  snprintf(where, wherelen, "device %d", device);
  return 0;
}

/* Load image ``id`` into the device's primary context, as the handler would on its first
   call there: a load error surfaces when the call is built, in Python, and the handler finds
   the function already loaded. */
int lk_load_function(int device, int64_t id, char* err, size_t errlen) {
  CUcontext ctx;
  char where[32];
  if (lk_primary_context(device, &ctx, where, sizeof where, err, errlen)) return -1;
  pthread_mutex_lock(&lk_mutex);
  lk_loaded* l = lk_function(id, ctx, where, err, errlen);
  pthread_mutex_unlock(&lk_mutex);
  return l ? 0 : -1;
}

/* The device of the calling thread's current context (device 0 when it has none, which is
   Numba's current device then too), its compute capability and its number of SMs: what a
   kernel.jax call is built for, asked without Numba when the kernel's cubin is cached. */
int lk_current_device(int* device, int* major, int* minor, int* sms, char* err, size_t errlen) {
  if (lk_resolve(err, errlen)) return -1;
  CUresult r;
  CUcontext ctx = NULL;
  CUdevice dev = 0;
  if ((r = p_cuInit(0))) { lk_cuda_error("cuInit", r, err, errlen); return -1; }
  if ((r = p_cuCtxGetCurrent(&ctx))) { lk_cuda_error("cuCtxGetCurrent", r, err, errlen); return -1; }
  if (ctx) {
    if ((r = p_cuCtxGetDevice(&dev))) { lk_cuda_error("cuCtxGetDevice", r, err, errlen); return -1; }
  } else if ((r = p_cuDeviceGet(&dev, 0))) {
    lk_cuda_error("cuDeviceGet", r, err, errlen);
    return -1;
  }
  if ((r = p_cuDeviceGetAttribute(major, LK_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)) ||
      (r = p_cuDeviceGetAttribute(minor, LK_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)) ||
      (r = p_cuDeviceGetAttribute(sms, LK_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))) {
    lk_cuda_error("cuDeviceGetAttribute", r, err, errlen);
    return -1;
  }
  *device = (int)dev;
  return 0;
}

/* Device ``device``'s shared memory: the most a block may opt in to, and what an SM holds
   (tile mode sizes its tiles by them; kernel.jax asks without Numba). */
int lk_device_shared(int device, int* per_block_optin, int* per_sm, char* err, size_t errlen) {
  if (lk_resolve(err, errlen)) return -1;
  CUresult r;
  CUdevice dev;
  if ((r = p_cuInit(0))) { lk_cuda_error("cuInit", r, err, errlen); return -1; }
  if ((r = p_cuDeviceGet(&dev, device))) { lk_cuda_error("cuDeviceGet", r, err, errlen); return -1; }
  if ((r = p_cuDeviceGetAttribute(per_block_optin, LK_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)) ||
      (r = p_cuDeviceGetAttribute(per_sm, LK_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, dev))) {
    lk_cuda_error("cuDeviceGetAttribute", r, err, errlen);
    return -1;
  }
  return 0;
}

/* For image ``id`` in device ``device``'s primary context (loaded there on first use): the most
   threads per block its function can run, and (threads > 0) how many blocks of ``threads``
   threads with ``shared`` bytes of dynamic shared memory fit on the device at once. */
int lk_function_limits(int device, int64_t id, int64_t threads, int64_t shared, int* max_threads, int64_t* blocks,
                       int* static_shared, char* err, size_t errlen) {
  *blocks = 0;
  CUcontext ctx;
  char where[32];
  if (lk_primary_context(device, &ctx, where, sizeof where, err, errlen)) return -1;
  CUresult r;
  int rc = -1;
  pthread_mutex_lock(&lk_mutex);
  lk_loaded* l = lk_function(id, ctx, where, err, errlen);
  if (l) {
    CUcontext popped;
    r = p_cuCtxPushCurrent(l->ctx);
    if (!r) {
      r = p_cuFuncGetAttribute(max_threads, LK_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, l->f);
      if (!r) r = p_cuFuncGetAttribute(static_shared, LK_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, l->f);
      p_cuCtxPopCurrent(&popped);
    }
    if (r)
      lk_cuda_error("cuFuncGetAttribute", r, err, errlen);
    /* the occupancy of a launch with more dynamic shared memory than the default counts only
       once the function is allowed it, as the launch itself does (lk_allow_shared) */
    else if (threads <= 0 || (!lk_allow_shared(l, shared, err, errlen) &&
                              !lk_coresident(l, threads, shared, blocks, err, errlen)))
      rc = 0;
  }
  pthread_mutex_unlock(&lk_mutex);
  return rc;
}

static XLA_FFI_Error* lk_error(const XLA_FFI_Api* api, const char* msg) {
  XLA_FFI_Error_Create_Args a;
  memset(&a, 0, sizeof a);
  a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  a.message = msg;
  a.errc = XLA_FFI_Error_Code_INVALID_ARGUMENT;
  return api->XLA_FFI_Error_Create(&a);
}

static int64_t lk_itemsize(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_PRED: case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8: return 1;
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: case XLA_FFI_DataType_F16: return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32: return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64: return 8;
    default: return 0;
  }
}

static void* lk_attr(XLA_FFI_CallFrame* cf, const char* name, XLA_FFI_AttrType type) {
  size_t n = strlen(name);
  for (int64_t i = 0; i < cf->attrs.size; ++i) {
    XLA_FFI_ByteSpan* s = cf->attrs.names[i];
    if (s->len == n && !memcmp(s->ptr, name, n) && cf->attrs.types[i] == type) return cf->attrs.attrs[i];
  }
  return NULL;
}

#define LK_MAX_WORDS 1024

static int64_t lk_scalar(XLA_FFI_CallFrame* cf, const char* name, int* ok) {
  XLA_FFI_Scalar* a = (XLA_FFI_Scalar*)lk_attr(cf, name, XLA_FFI_AttrType_SCALAR);
  if (!a || a->dtype != XLA_FFI_DataType_S64) {
    *ok = 0;
    return 0;
  }
  return *(int64_t*)a->value;
}

/* The i-th result if it is a buffer, else NULL. */
static XLA_FFI_Buffer* lk_result(XLA_FFI_CallFrame* cf, int64_t i) {
  if (i < 0 || i >= cf->rets.size || cf->rets.types[i] != XLA_FFI_RetType_BUFFER) return NULL;
  return (XLA_FFI_Buffer*)cf->rets.rets[i];
}

static int64_t lk_bytes(XLA_FFI_Buffer* b) {
  int64_t n = lk_itemsize(b->dtype);
  for (int64_t d = 0; d < b->rank; ++d) n *= b->dims[d];
  return n;
}

XLA_FFI_Error* lk_launch(XLA_FFI_CallFrame* cf) {
  if (cf->extension_start && cf->extension_start->type == XLA_FFI_Extension_Metadata) {
    XLA_FFI_Metadata* md = ((XLA_FFI_Metadata_Extension*)cf->extension_start)->metadata;
    md->api_version.major_version = XLA_FFI_API_MAJOR;
    md->api_version.minor_version = XLA_FFI_API_MINOR;
    md->traits = 0;  /* not claimed command-buffer safe: see xla_ffi.py */
    return NULL;
  }
  const XLA_FFI_Api* api = cf->api;
  char err[512];  /* XLA_FFI_Error_Create copies the message */
  if (cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (lk_resolve(err, sizeof err)) return lk_error(api, err);

  int ok = 1;
  int64_t kernel = lk_scalar(cf, "kernel", &ok), blocks = lk_scalar(cf, "blocks", &ok);
  int64_t threads = lk_scalar(cf, "threads", &ok), coop = lk_scalar(cf, "cooperative", &ok);
  int64_t control = lk_scalar(cf, "control", &ok), timeout_ns = lk_scalar(cf, "timeout_ns", &ok);
  int64_t timeout_slot = lk_scalar(cf, "timeout_slot", &ok), count = lk_scalar(cf, "count", &ok);
  int64_t steps_slot = lk_scalar(cf, "steps_slot", &ok), shared = lk_scalar(cf, "shared", &ok);
  XLA_FFI_Array* a_layout = (XLA_FFI_Array*)lk_attr(cf, "layout", XLA_FFI_AttrType_ARRAY);
  if (!ok || !a_layout || a_layout->dtype != XLA_FFI_DataType_S64 || a_layout->size % 5 || shared < 0 ||
      shared > INT32_MAX)
    return lk_error(api, "loopkern: the custom call's attributes are malformed (kernel, blocks, threads, cooperative, "
                         "layout, control, timeout_ns, timeout_slot, count, steps_slot, shared)");
  const int64_t* layout = (const int64_t*)a_layout->data;

  /* the control block: zeroed, then the timeout; the step count's destination */
  XLA_FFI_Buffer* ctl = lk_result(cf, control);
  int64_t ctl_bytes = ctl ? lk_bytes(ctl) : 0;
  if (!ctl || ctl_bytes <= 0 || ctl_bytes % 4 || timeout_slot < 0 || 8 * (timeout_slot + 1) > ctl_bytes ||
      steps_slot < 0 || 8 * (steps_slot + 1) > ctl_bytes)
    return lk_error(api, "loopkern: the control block result is missing or too small");
  XLA_FFI_Buffer* cnt = NULL;
  if (count >= 0) {
    cnt = lk_result(cf, count);
    if (!cnt || lk_itemsize(cnt->dtype) != 4 || lk_bytes(cnt) != 4)
      return lk_error(api, "loopkern: the step count result must be one 32-bit number");
  }

  uint64_t words[LK_MAX_WORDS];  /* on the stack: calls may run concurrently; the driver copies them */
  void* params[LK_MAX_WORDS];
  int64_t nw = 0;
  for (size_t p = 0; p < a_layout->size / 5; ++p) {
    const int64_t* e = layout + 5 * p;
    int64_t src = e[0], idx = e[1], view = e[2], off = e[3], len = e[4];
    XLA_FFI_Buffer* b = NULL;
    if (src == 0 && idx >= 0 && idx < cf->args.size && cf->args.types[idx] == XLA_FFI_ArgType_BUFFER)
      b = (XLA_FFI_Buffer*)cf->args.args[idx];
    else if (src == 1)
      b = lk_result(cf, idx);
    if (!b) return lk_error(api, "loopkern: layout names a buffer the call does not have");
    int64_t item = lk_itemsize(b->dtype);
    if (!item) return lk_error(api, "loopkern: unsupported buffer dtype");
    int64_t rank = b->rank, nitems = 1, dims[16];
    if (rank < 1 || rank > 16) return lk_error(api, "loopkern: buffers must have 1 to 16 dimensions");
    if (nw + 5 + 2 * rank > LK_MAX_WORDS) return lk_error(api, "loopkern: too many kernel parameters");
    for (int64_t d = 0; d < rank; ++d) dims[d] = b->dims[d];
    char* data = (char*)b->data;
    if (off || len) {  /* a part of a 1-D buffer: len elements (0: the rest) of the view, off bytes in */
      int64_t size = view > 0 ? view : item, bytes = rank == 1 ? dims[0] * item : 0;
      if (rank != 1 || off < 0 || len < 0 || off % size || off > bytes || len > (bytes - off) / size ||
          (!len && (bytes - off) % size))
        return lk_error(api, "loopkern: layout names a part outside its buffer");
      data += off;
      dims[0] = len ? len : (bytes - off) / size;
      item = size;
    } else if (view > 0) {
      if ((dims[rank - 1] * item) % view) return lk_error(api, "loopkern: scratch buffer size is not a whole number of elements");
      dims[rank - 1] = dims[rank - 1] * item / view;
      item = view;
    }
    for (int64_t d = 0; d < rank; ++d) nitems *= dims[d];
    words[nw++] = 0;                       /* meminfo */
    words[nw++] = 0;                       /* parent */
    words[nw++] = (uint64_t)nitems;
    words[nw++] = (uint64_t)item;
    words[nw++] = (uint64_t)(uintptr_t)data;
    for (int64_t d = 0; d < rank; ++d) words[nw++] = (uint64_t)dims[d];
    int64_t stride = item;
    for (int64_t d = rank - 1; d >= 0; --d) {  /* row-major strides in bytes */
      words[nw + d] = (uint64_t)stride;
      stride *= dims[d];
    }
    nw += rank;
  }
  for (int64_t k = 0; k < nw; ++k) params[k] = &words[k];

  XLA_FFI_Stream_Get_Args sa;
  memset(&sa, 0, sizeof sa);
  sa.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  sa.ctx = cf->ctx;
  XLA_FFI_Error* e = api->XLA_FFI_Stream_Get(&sa);
  if (e) return e;
  CUstream stream = (CUstream)sa.stream;

  /* the kernel in the context of XLA's stream: the same call runs on every device of a mesh */
  CUcontext ctx;
  CUresult r = p_cuStreamGetCtx(stream, &ctx);
  if (r) {
    lk_cuda_error("finding the context of XLA's stream (cuStreamGetCtx)", r, err, sizeof err);
    return lk_error(api, err);
  }
  pthread_mutex_lock(&lk_mutex);
  lk_loaded* l = lk_function(kernel, ctx, "the device of XLA's stream", err, sizeof err);
  int64_t limit = 0;
  int bad = !l || lk_allow_shared(l, shared, err, sizeof err) ||
            (coop && lk_coresident(l, threads, shared, &limit, err, sizeof err));
  CUfunction f = l ? l->f : NULL;
  CUdevice dev = l ? l->dev : -1;
  pthread_mutex_unlock(&lk_mutex);
  if (bad) return lk_error(api, err);
  if (coop && blocks > limit) {
    snprintf(err, sizeof err, "loopkern: the grid of %lld blocks cannot be co-resident on device %d (at most %lld "
             "blocks of %lld threads of this kernel fit there at once), and a cooperative launch needs all of them: "
             "the grid was sized on the GPU that was current when the call was built; on a mesh of unlike GPUs "
             "pass blocks=%lld or fewer", (long long)blocks, (int)dev, (long long)limit, (long long)threads,
             (long long)limit);
    return lk_error(api, err);
  }

  /* the control block (and the barrier counter after it) to zero, then the timeout's nonzero
     words (little-endian: the low word first); the kernel writes the other slots */
  /* the arrays are read from the results, which input_output_aliases makes the inputs' buffers;
     a result that XLA placed elsewhere (nothing guarantees it inside every fusion or loop) gets
     its input's contents first, so the kernel never runs on an uninitialised result */
  XLA_FFI_Array* a_alias = (XLA_FFI_Array*)lk_attr(cf, "aliases", XLA_FFI_AttrType_ARRAY);
  if (!a_alias || a_alias->dtype != XLA_FFI_DataType_S64 || a_alias->size % 2)
    return lk_error(api, "loopkern: the custom call's attribute 'aliases' is malformed");
  for (size_t k = 0; k < a_alias->size / 2; ++k) {
    int64_t ai = ((const int64_t*)a_alias->data)[2 * k], ri = ((const int64_t*)a_alias->data)[2 * k + 1];
    if (ai < 0) continue;  /* (-1, -1): a call without arrays */
    XLA_FFI_Buffer* in = ai >= 0 && ai < cf->args.size && cf->args.types[ai] == XLA_FFI_ArgType_BUFFER
                             ? (XLA_FFI_Buffer*)cf->args.args[ai] : NULL;
    XLA_FFI_Buffer* out = lk_result(cf, ri);
    if (!in || !out || lk_bytes(in) != lk_bytes(out))
      return lk_error(api, "loopkern: 'aliases' names an input and a result that do not match");
    if (in->data != out->data && lk_bytes(in) > 0) {
      if (getenv("LOOPKERN_FFI_TRACE"))
        fprintf(stderr, "loopkern: input %lld and result %lld are separate buffers: copied\n", (long long)ai,
                (long long)ri);
      r = p_cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)out->data, (CUdeviceptr)(uintptr_t)in->data,
                              (size_t)lk_bytes(in), stream);
      if (r) {
        lk_cuda_error("copying an input to its result", r, err, sizeof err);
        return lk_error(api, err);
      }
    }
  }
  CUdeviceptr ctl_ptr = (CUdeviceptr)(uintptr_t)ctl->data;
  r = p_cuMemsetD32Async(ctl_ptr, 0, (size_t)(ctl_bytes / 4), stream);
  for (int w = 0; !r && w < 2; ++w) {
    unsigned int v = (unsigned int)((uint64_t)timeout_ns >> (32 * w));
    if (v) r = p_cuMemsetD32Async(ctl_ptr + 8 * (CUdeviceptr)timeout_slot + 4 * (CUdeviceptr)w, v, 1, stream);
  }
  if (r) {
    lk_cuda_error("initialising the control block", r, err, sizeof err);
    return lk_error(api, err);
  }
  r = coop ? p_cuLaunchCooperativeKernel(f, (unsigned)blocks, 1, 1, (unsigned)threads, 1, 1, (unsigned)shared, stream,
                                         params)
           : p_cuLaunchKernel(f, (unsigned)blocks, 1, 1, (unsigned)threads, 1, 1, (unsigned)shared, stream, params,
                              NULL);
  if (r) {
    lk_cuda_error("launching the megakernel", r, err, sizeof err);
    return lk_error(api, err);
  }
  if (cnt) {
    r = p_cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)cnt->data, ctl_ptr + 8 * (CUdeviceptr)steps_slot, 4, stream);
    if (r) {
      lk_cuda_error("reading the step count", r, err, sizeof err);
      return lk_error(api, err);
    }
  }
  return NULL;
}

/* The handler's address, for registration from Python (cffi exposes plain functions only). */
void* lk_launch_address(void) { return (void*)&lk_launch; }
