/*
 * A fake libnvidia-ml.so.1 for tests: unmodified pynvml loads it through ctypes and gets
 * the same return codes and struct layouts a real driver gives, so the guardian's NVML
 * source is exercised through the real bindings and error classes without a GPU.
 *
 * State lives in a small text file named by the env var FAKE_NVML_STATE. It is re-read on
 * every call, so a test changes GPUs, memory, processes, lost GPUs, XID events and init
 * return codes between collects by rewriting the file. One directive per line, '#' starts
 * a comment:
 *
 *   init_rc 9                  nvmlInitWithFlags returns this code (default 0)
 *   count_rc 999               nvmlDeviceGetCount_v2 returns this code (default 0)
 *   driver 550.54.15           nvmlSystemGetDriverVersion (absent: NOT_SUPPORTED)
 *   gpu INDEX key=value ...    one GPU; keys: uuid name total used free util temp power_mw
 *                              remap=PENDING,FAILURE retired=0|1 lost=0|1 procs=na
 *                              util_rc=N: utilization returns code N (an error that
 *                              arrives mid-device, after uuid and memory were read)
 *                              A value "na" makes that query return NOT_SUPPORTED.
 *                              '_' in name becomes a space. lost=1: every per-device query
 *                              but GetHandleByIndex/GetIndex returns GPU_IS_LOST.
 *   proc INDEX compute|graphics PID USED_BYTES|na
 *   xid INDEX XID SEQ          an XID critical error; SEQ increases over the file's life
 *
 * Events are delivered like the real driver: only those that happen after the event set
 * was created (seq above the highest seq present at creation), each once, in seq order.
 *
 * If FAKE_NVML_CALLS names a file, the session's entry points (init, shutdown, count, event
 * set), the driver version and the per-device handle, UUID, name and memory calls append
 * their name there, so a test can count how often the guardian called them.
 *
 * Build: gcc -shared -fPIC -O2 -o libnvidia-ml.so.1 fake_nvml.c
 * -DFAKE_NVML_VARIANT='"-b"' appends "-b" to the driver version, so a test can tell which
 * of two loaded copies of the library answered.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OK 0
#define E_UNINITIALIZED 1
#define E_INVALID_ARGUMENT 2
#define E_NOT_SUPPORTED 3
#define E_INSUFFICIENT_SIZE 7
#define E_DRIVER_NOT_LOADED 9
#define E_TIMEOUT 10
#define E_FUNCTION_NOT_FOUND 13
#define E_GPU_IS_LOST 15
#define E_ARGUMENT_VERSION_MISMATCH 25

#define MAX_GPUS 16
#define MAX_PROCS 64
#define MAX_XIDS 256
#define NA (-1LL)
#ifndef FAKE_NVML_VARIANT
#define FAKE_NVML_VARIANT ""
#endif

typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* v2 == v3 layout */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    int present;
    char uuid[96];
    char name[96];
    long long total, used, free, util, temp, power_mw, remap_pending, remap_failure, retired;
    long long reserved; /* the driver's own reservation: v1 counts it as used, v2 apart */
    int no_memory_v2;   /* memory_v2=0: a driver before nvmlDeviceGetMemoryInfo_v2 */
    int lost, procs_na, util_rc;
} gpu_t;
typedef struct { int gpu; int graphics; unsigned pid; long long used; } proc_t;
typedef struct { int gpu; unsigned long long xid; long long seq; } xid_t;

typedef struct {
    int init_rc, count_rc, have_driver, ngpus, nprocs, nxids;
    char driver[80];
    gpu_t gpus[MAX_GPUS];
    proc_t procs[MAX_PROCS];
    xid_t xids[MAX_XIDS];
} state_t;

typedef struct {
    unsigned long long registered; /* bit per GPU index */
    long long last_seq;
} event_set_t;

static int g_initialized = 0;

static void log_call(const char *name) {
    const char *path = getenv("FAKE_NVML_CALLS");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s\n", name);
    fclose(f);
}

static long long num(const char *v) {
    if (strcmp(v, "na") == 0) return NA;
    return strtoll(v, NULL, 10);
}

/* Returns 0 when the state file could be read. */
static int load(state_t *s) {
    memset(s, 0, sizeof(*s));
    const char *path = getenv("FAKE_NVML_STATE");
    if (!path) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *save = NULL;
        char *word = strtok_r(line, " \t\r\n", &save);
        if (!word) continue;
        if (strcmp(word, "init_rc") == 0) {
            char *v = strtok_r(NULL, " \t\r\n", &save);
            if (v) s->init_rc = atoi(v);
        } else if (strcmp(word, "count_rc") == 0) {
            char *v = strtok_r(NULL, " \t\r\n", &save);
            if (v) s->count_rc = atoi(v);
        } else if (strcmp(word, "driver") == 0) {
            char *v = strtok_r(NULL, " \t\r\n", &save);
            if (v) {
                snprintf(s->driver, sizeof s->driver, "%s", v);
                s->have_driver = 1;
            }
        } else if (strcmp(word, "gpu") == 0) {
            char *v = strtok_r(NULL, " \t\r\n", &save);
            if (!v) continue;
            int i = atoi(v);
            if (i < 0 || i >= MAX_GPUS) continue;
            gpu_t *g = &s->gpus[i];
            g->present = 1;
            snprintf(g->uuid, sizeof g->uuid, "GPU-fake-%d", i);
            snprintf(g->name, sizeof g->name, "Fake H100 80GB");
            g->total = 85899345920LL;
            g->used = 0;
            g->free = NA - 1; /* "not given": total - used */
            g->util = 0;
            g->temp = 40;
            g->power_mw = 100000;
            g->retired = 0;
            g->reserved = 0;
            g->no_memory_v2 = 0;
            if (i + 1 > s->ngpus) s->ngpus = i + 1;
            char *kv;
            while ((kv = strtok_r(NULL, " \t\r\n", &save))) {
                char *eq = strchr(kv, '=');
                if (!eq) continue;
                *eq = 0;
                const char *k = kv, *val = eq + 1;
                if (strcmp(k, "uuid") == 0) snprintf(g->uuid, sizeof g->uuid, "%s", val);
                else if (strcmp(k, "name") == 0) {
                    snprintf(g->name, sizeof g->name, "%s", val);
                    for (char *p = g->name; *p; p++) if (*p == '_') *p = ' ';
                } else if (strcmp(k, "total") == 0) g->total = num(val);
                else if (strcmp(k, "used") == 0) g->used = num(val);
                else if (strcmp(k, "free") == 0) g->free = num(val);
                else if (strcmp(k, "reserved") == 0) g->reserved = num(val);
                else if (strcmp(k, "memory_v2") == 0) g->no_memory_v2 = atoi(val) == 0;
                else if (strcmp(k, "util") == 0) g->util = num(val);
                else if (strcmp(k, "temp") == 0) g->temp = num(val);
                else if (strcmp(k, "power_mw") == 0) g->power_mw = num(val);
                else if (strcmp(k, "retired") == 0) g->retired = num(val);
                else if (strcmp(k, "lost") == 0) g->lost = atoi(val);
                else if (strcmp(k, "util_rc") == 0) g->util_rc = atoi(val);
                else if (strcmp(k, "procs") == 0) g->procs_na = strcmp(val, "na") == 0;
                else if (strcmp(k, "remap") == 0) {
                    if (strcmp(val, "na") == 0) {
                        g->remap_pending = g->remap_failure = NA;
                    } else {
                        g->remap_pending = strtoll(val, NULL, 10);
                        const char *c = strchr(val, ',');
                        g->remap_failure = c ? strtoll(c + 1, NULL, 10) : 0;
                    }
                }
            }
        } else if (strcmp(word, "proc") == 0 && s->nprocs < MAX_PROCS) {
            char *gi = strtok_r(NULL, " \t\r\n", &save);
            char *kind = strtok_r(NULL, " \t\r\n", &save);
            char *pid = strtok_r(NULL, " \t\r\n", &save);
            char *used = strtok_r(NULL, " \t\r\n", &save);
            if (!gi || !kind || !pid || !used) continue;
            proc_t *p = &s->procs[s->nprocs++];
            p->gpu = atoi(gi);
            p->graphics = strcmp(kind, "graphics") == 0;
            p->pid = (unsigned)strtoul(pid, NULL, 10);
            p->used = num(used);
        } else if (strcmp(word, "xid") == 0 && s->nxids < MAX_XIDS) {
            char *gi = strtok_r(NULL, " \t\r\n", &save);
            char *x = strtok_r(NULL, " \t\r\n", &save);
            char *seq = strtok_r(NULL, " \t\r\n", &save);
            if (!gi || !x || !seq) continue;
            xid_t *e = &s->xids[s->nxids++];
            e->gpu = atoi(gi);
            e->xid = strtoull(x, NULL, 10);
            e->seq = strtoll(seq, NULL, 10);
        }
    }
    fclose(f);
    return 0;
}

/* Loads the state and resolves a handle to its GPU; returns an NVML code. */
static int device(nvmlDevice_t h, state_t *s, gpu_t **g, int allow_lost) {
    if (!g_initialized) return E_UNINITIALIZED;
    if (load(s) != 0) return E_DRIVER_NOT_LOADED;
    long i = (long)(size_t)h - 1;
    if (i < 0 || i >= MAX_GPUS || !s->gpus[i].present) return E_INVALID_ARGUMENT;
    *g = &s->gpus[i];
    if ((*g)->lost && !allow_lost) return E_GPU_IS_LOST;
    return OK;
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    log_call("nvmlInitWithFlags");
    state_t s;
    if (load(&s) != 0) return E_DRIVER_NOT_LOADED;
    if (s.init_rc != 0) return s.init_rc;
    g_initialized++;
    return OK;
}

int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

int nvmlShutdown(void) {
    log_call("nvmlShutdown");
    if (!g_initialized) return E_UNINITIALIZED;
    g_initialized--;
    return OK;
}

const char *nvmlErrorString(int rc) {
    switch (rc) {
    case OK: return "Success";
    case E_UNINITIALIZED: return "Uninitialized";
    case E_INVALID_ARGUMENT: return "Invalid Argument";
    case E_NOT_SUPPORTED: return "Not Supported";
    case E_INSUFFICIENT_SIZE: return "Insufficient Size";
    case E_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case E_TIMEOUT: return "Timeout";
    case E_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

int nvmlSystemGetDriverVersion(char *buf, unsigned int len) {
    log_call("nvmlSystemGetDriverVersion");
    state_t s;
    if (!g_initialized) return E_UNINITIALIZED;
    if (load(&s) != 0) return E_DRIVER_NOT_LOADED;
    if (!s.have_driver) return E_NOT_SUPPORTED;
    if (len < strlen(s.driver) + strlen(FAKE_NVML_VARIANT) + 1) return E_INSUFFICIENT_SIZE;
    snprintf(buf, len, "%s%s", s.driver, FAKE_NVML_VARIANT);
    return OK;
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    state_t s;
    log_call("nvmlDeviceGetCount_v2");
    if (!g_initialized) return E_UNINITIALIZED;
    if (load(&s) != 0) return E_DRIVER_NOT_LOADED;
    if (s.count_rc != 0) return s.count_rc;
    *count = (unsigned)s.ngpus;
    return OK;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *h) {
    log_call("nvmlDeviceGetHandleByIndex_v2");
    state_t s;
    if (!g_initialized) return E_UNINITIALIZED;
    if (load(&s) != 0) return E_DRIVER_NOT_LOADED;
    if (index >= MAX_GPUS || !s.gpus[index].present) return E_INVALID_ARGUMENT;
    *h = (nvmlDevice_t)(size_t)(index + 1); /* never NULL: ctypes would see a null pointer */
    return OK;
}

int nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index) {
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 1);
    if (rc) return rc;
    *index = (unsigned)((size_t)h - 1);
    return OK;
}

static int copy_str(const char *src, char *buf, unsigned int len) {
    if (len < strlen(src) + 1) return E_INSUFFICIENT_SIZE;
    snprintf(buf, len, "%s", src);
    return OK;
}

int nvmlDeviceGetUUID(nvmlDevice_t h, char *buf, unsigned int len) {
    log_call("nvmlDeviceGetUUID");
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    return rc ? rc : copy_str(g->uuid, buf, len);
}

int nvmlDeviceGetName(nvmlDevice_t h, char *buf, unsigned int len) {
    log_call("nvmlDeviceGetName");
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    return rc ? rc : copy_str(g->name, buf, len);
}

int nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *m) {
    log_call("nvmlDeviceGetMemoryInfo");
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (g->total == NA || g->used == NA) return E_NOT_SUPPORTED;
    m->total = (unsigned long long)g->total;
    m->used = (unsigned long long)g->used;
    m->free = g->free == NA - 1 ? (unsigned long long)(g->total - g->used) : (unsigned long long)g->free;
    return OK;
}

typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

/* v2: total as v1, the reservation apart, used without it (what CUDA counts as used). */
int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *m) {
    log_call("nvmlDeviceGetMemoryInfo_v2");
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (g->no_memory_v2) return E_FUNCTION_NOT_FOUND;
    if (m->version != 0x02000028) return E_ARGUMENT_VERSION_MISMATCH;
    if (g->total == NA || g->used == NA) return E_NOT_SUPPORTED;
    m->total = (unsigned long long)g->total;
    m->reserved = (unsigned long long)g->reserved;
    m->used = (unsigned long long)(g->used - g->reserved);
    m->free = g->free == NA - 1 ? (unsigned long long)(g->total - g->used) : (unsigned long long)g->free;
    return OK;
}

int nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u) {
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (g->util_rc) return g->util_rc;
    if (g->util == NA) return E_NOT_SUPPORTED;
    u->gpu = (unsigned)g->util;
    u->memory = 0;
    return OK;
}

int nvmlDeviceGetTemperature(nvmlDevice_t h, int sensor, unsigned int *temp) {
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (sensor != 0) return E_INVALID_ARGUMENT;
    if (g->temp == NA) return E_NOT_SUPPORTED;
    *temp = (unsigned)g->temp;
    return OK;
}

int nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int *mw) {
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (g->power_mw == NA) return E_NOT_SUPPORTED;
    *mw = (unsigned)g->power_mw;
    return OK;
}

int nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int *corr, unsigned int *unc,
                              unsigned int *pending, unsigned int *failure) {
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (g->remap_pending == NA) return E_NOT_SUPPORTED;
    *corr = 0;
    *unc = 0;
    *pending = (unsigned)g->remap_pending;
    *failure = (unsigned)g->remap_failure;
    return OK;
}

int nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t h, int *pending) {
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (g->retired == NA) return E_NOT_SUPPORTED;
    *pending = (int)g->retired;
    return OK;
}

static int processes(nvmlDevice_t h, int graphics, unsigned int *count, nvmlProcessInfo_t *infos) {
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (g->procs_na) return E_NOT_SUPPORTED;
    int gi = (int)((size_t)h - 1);
    unsigned n = 0;
    for (int i = 0; i < s.nprocs; i++)
        if (s.procs[i].gpu == gi && s.procs[i].graphics == graphics) n++;
    if (n == 0) {
        *count = 0;
        return OK;
    }
    if (infos == NULL || *count < n) {
        *count = n;
        return E_INSUFFICIENT_SIZE;
    }
    unsigned k = 0;
    for (int i = 0; i < s.nprocs; i++) {
        proc_t *p = &s.procs[i];
        if (p->gpu != gi || p->graphics != graphics) continue;
        infos[k].pid = p->pid;
        infos[k].usedGpuMemory = p->used == NA ? 0xFFFFFFFFFFFFFFFFULL : (unsigned long long)p->used;
        infos[k].gpuInstanceId = 0xFFFFFFFFu;
        infos[k].computeInstanceId = 0xFFFFFFFFu;
        k++;
    }
    *count = n;
    return OK;
}

int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos) {
    return processes(h, 0, count, infos);
}

int nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos) {
    return processes(h, 1, count, infos);
}

int nvmlEventSetCreate(void **set) {
    state_t s;
    log_call("nvmlEventSetCreate");
    if (!g_initialized) return E_UNINITIALIZED;
    if (load(&s) != 0) return E_DRIVER_NOT_LOADED;
    event_set_t *es = calloc(1, sizeof *es);
    if (!es) return 20; /* NVML_ERROR_MEMORY */
    for (int i = 0; i < s.nxids; i++)
        if (s.xids[i].seq > es->last_seq) es->last_seq = s.xids[i].seq;
    *set = es;
    return OK;
}

int nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long types, void *set) {
    state_t s;
    gpu_t *g;
    int rc = device(h, &s, &g, 0);
    if (rc) return rc;
    if (!set) return E_INVALID_ARGUMENT;
    if (types & ~0x8ULL) return E_NOT_SUPPORTED; /* only XID critical errors are faked */
    ((event_set_t *)set)->registered |= 1ULL << ((size_t)h - 1);
    return OK;
}

int nvmlEventSetWait_v2(void *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    (void)timeout_ms; /* never blocks: the state file is the only event source */
    state_t s;
    if (!g_initialized) return E_UNINITIALIZED;
    if (!set) return E_INVALID_ARGUMENT;
    if (load(&s) != 0) return E_DRIVER_NOT_LOADED;
    event_set_t *es = set;
    for (;;) {
        int best = -1;
        for (int i = 0; i < s.nxids; i++)
            if (s.xids[i].seq > es->last_seq && (best < 0 || s.xids[i].seq < s.xids[best].seq)) best = i;
        if (best < 0) return E_TIMEOUT;
        es->last_seq = s.xids[best].seq;
        int gi = s.xids[best].gpu;
        if (gi < 0 || gi >= 64 || !(es->registered & (1ULL << gi))) continue;
        data->device = (nvmlDevice_t)(size_t)(gi + 1);
        data->eventType = 0x8ULL;
        data->eventData = s.xids[best].xid;
        data->gpuInstanceId = 0xFFFFFFFFu;
        data->computeInstanceId = 0xFFFFFFFFu;
        return OK;
    }
}

int nvmlEventSetFree(void *set) {
    log_call("nvmlEventSetFree");
    if (!set) return E_INVALID_ARGUMENT;
    free(set);
    return OK;
}
