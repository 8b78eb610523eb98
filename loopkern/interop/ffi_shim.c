/* loopkern's XLA FFI shim: launch a Numba-compiled cooperative megakernel on XLA's stream.
 *
 * Built with cffi on first use (see xla_ffi.py). libcuda is resolved with dlopen at run time,
 * so this builds on machines without a GPU or a driver; only the XLA FFI header is needed.
 *
 * The kernel's parameters are all arrays here (scalars and the step count arrive as 1-element
 * buffers), passed in Numba's array ABI: for each array, 5 + 2*ndim 8-byte parameters
 * (meminfo, parent, nitems, itemsize, data, shape[ndim], strides[ndim] in bytes, row-major).
 * The attribute "layout" lists, for every kernel parameter in order, where its buffer is and
 * how to view it: (0, i, v) for the i-th argument or (1, i, v) for the i-th result; v > 0
 * views the buffer as elements of v bytes (scratch buffers are bytes to XLA, since JAX
 * without x64 has no 64-bit types), v == 0 keeps its own dtype.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDeviceGet)(CUdevice*, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
static CUresult (*p_cuCtxPushCurrent)(CUcontext);
static CUresult (*p_cuCtxPopCurrent)(CUcontext*);
static CUresult (*p_cuModuleLoadData)(CUmodule*, const void*);
static CUresult (*p_cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
static CUresult (*p_cuLaunchCooperativeKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                               unsigned, unsigned, CUstream, void**);
static CUresult (*p_cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void**, void**);
static CUresult (*p_cuGetErrorName)(CUresult, const char**);

static int lk_resolve(char* err, size_t errlen) {
  static void* lib = NULL;
  if (lib) return 0;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    snprintf(err, errlen, "loopkern: cannot load libcuda (%s)", dlerror());
    return -1;
  }
#define LK_SYM(var, name)                                                   \
  *(void**)(&var) = dlsym(h, name);                                         \
  if (!var) {                                                               \
    snprintf(err, errlen, "loopkern: libcuda has no symbol %s", name);      \
    return -1;                                                              \
  }
  LK_SYM(p_cuInit, "cuInit")
  LK_SYM(p_cuDeviceGet, "cuDeviceGet")
  LK_SYM(p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
  LK_SYM(p_cuCtxPushCurrent, "cuCtxPushCurrent_v2")
  LK_SYM(p_cuCtxPopCurrent, "cuCtxPopCurrent_v2")
  LK_SYM(p_cuModuleLoadData, "cuModuleLoadData")
  LK_SYM(p_cuModuleGetFunction, "cuModuleGetFunction")
  LK_SYM(p_cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel")
  LK_SYM(p_cuLaunchKernel, "cuLaunchKernel")
  LK_SYM(p_cuGetErrorName, "cuGetErrorName")
#undef LK_SYM
  lib = h;
  return 0;
}

static void lk_cuda_error(const char* what, CUresult r, char* err, size_t errlen) {
  const char* name = "unknown";
  if (p_cuGetErrorName) p_cuGetErrorName(r, &name);
  snprintf(err, errlen, "loopkern: %s failed: %s (%d)", what, name ? name : "?", r);
}

/* Load a cubin into the device's primary context (the one JAX uses); returns the function. */
int lk_load_function(int device, const void* image, const char* name, uint64_t* func, char* err,
                     size_t errlen) {
  if (lk_resolve(err, errlen)) return -1;
  CUresult r;
  CUdevice dev;
  CUcontext ctx, popped;
  CUmodule mod;
  CUfunction f;
  if ((r = p_cuInit(0))) { lk_cuda_error("cuInit", r, err, errlen); return -1; }
  if ((r = p_cuDeviceGet(&dev, device))) { lk_cuda_error("cuDeviceGet", r, err, errlen); return -1; }
  if ((r = p_cuDevicePrimaryCtxRetain(&ctx, dev))) { lk_cuda_error("cuDevicePrimaryCtxRetain", r, err, errlen); return -1; }
  if ((r = p_cuCtxPushCurrent(ctx))) { lk_cuda_error("cuCtxPushCurrent", r, err, errlen); return -1; }
  r = p_cuModuleLoadData(&mod, image);
  if (!r) r = p_cuModuleGetFunction(&f, mod, name);
  p_cuCtxPopCurrent(&popped);
  if (r) { lk_cuda_error("loading the kernel", r, err, errlen); return -1; }
  *func = (uint64_t)(uintptr_t)f;
  return 0;
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

  XLA_FFI_Scalar* a_func = (XLA_FFI_Scalar*)lk_attr(cf, "func", XLA_FFI_AttrType_SCALAR);
  XLA_FFI_Scalar* a_blocks = (XLA_FFI_Scalar*)lk_attr(cf, "blocks", XLA_FFI_AttrType_SCALAR);
  XLA_FFI_Scalar* a_threads = (XLA_FFI_Scalar*)lk_attr(cf, "threads", XLA_FFI_AttrType_SCALAR);
  XLA_FFI_Scalar* a_coop = (XLA_FFI_Scalar*)lk_attr(cf, "cooperative", XLA_FFI_AttrType_SCALAR);
  XLA_FFI_Array* a_layout = (XLA_FFI_Array*)lk_attr(cf, "layout", XLA_FFI_AttrType_ARRAY);
  if (!a_func || !a_blocks || !a_threads || !a_layout || !a_coop || a_func->dtype != XLA_FFI_DataType_S64 ||
      a_layout->dtype != XLA_FFI_DataType_S64 || a_layout->size % 3)
    return lk_error(api, "loopkern: the custom call's attributes are malformed (func, blocks, threads, cooperative, layout)");
  CUfunction f = (CUfunction)(uintptr_t)(*(int64_t*)a_func->value);
  int64_t blocks = *(int64_t*)a_blocks->value, threads = *(int64_t*)a_threads->value;
  int64_t coop = *(int64_t*)a_coop->value;
  const int64_t* layout = (const int64_t*)a_layout->data;

  uint64_t words[LK_MAX_WORDS];  /* on the stack: calls may run concurrently; the driver copies them */
  void* params[LK_MAX_WORDS];
  int64_t nw = 0;
  for (size_t p = 0; p < a_layout->size / 3; ++p) {
    int64_t src = layout[3 * p], idx = layout[3 * p + 1], view = layout[3 * p + 2];
    XLA_FFI_Buffer* b;
    if (src == 0 && idx < cf->args.size && cf->args.types[idx] == XLA_FFI_ArgType_BUFFER)
      b = (XLA_FFI_Buffer*)cf->args.args[idx];
    else if (src == 1 && idx < cf->rets.size && cf->rets.types[idx] == XLA_FFI_RetType_BUFFER)
      b = (XLA_FFI_Buffer*)cf->rets.rets[idx];
    else
      return lk_error(api, "loopkern: layout names a buffer the call does not have");
    int64_t item = lk_itemsize(b->dtype);
    if (!item) return lk_error(api, "loopkern: unsupported buffer dtype");
    int64_t rank = b->rank, nitems = 1, dims[16];
    if (rank < 1 || rank > 16) return lk_error(api, "loopkern: buffers must have 1 to 16 dimensions");
    if (nw + 5 + 2 * rank > LK_MAX_WORDS) return lk_error(api, "loopkern: too many kernel parameters");
    for (int64_t d = 0; d < rank; ++d) dims[d] = b->dims[d];
    if (view > 0) {
      if ((dims[rank - 1] * item) % view) return lk_error(api, "loopkern: scratch buffer size is not a whole number of elements");
      dims[rank - 1] = dims[rank - 1] * item / view;
      item = view;
    }
    for (int64_t d = 0; d < rank; ++d) nitems *= dims[d];
    words[nw++] = 0;                       /* meminfo */
    words[nw++] = 0;                       /* parent */
    words[nw++] = (uint64_t)nitems;
    words[nw++] = (uint64_t)item;
    words[nw++] = (uint64_t)(uintptr_t)b->data;
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
  CUresult r = coop ? p_cuLaunchCooperativeKernel(f, (unsigned)blocks, 1, 1, (unsigned)threads, 1, 1, 0,
                                                  (CUstream)sa.stream, params)
                    : p_cuLaunchKernel(f, (unsigned)blocks, 1, 1, (unsigned)threads, 1, 1, 0, (CUstream)sa.stream,
                                       params, NULL);
  if (r) {
    lk_cuda_error("launching the megakernel", r, err, sizeof err);
    return lk_error(api, err);
  }
  return NULL;
}

/* The handler's address, for registration from Python (cffi exposes plain functions only). */
void* lk_launch_address(void) { return (void*)&lk_launch; }
