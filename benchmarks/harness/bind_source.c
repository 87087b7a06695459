/* LD_PRELOAD shim for the topology benchmark: every outgoing IPv4 TCP connection of this process is bound
 * to the source address in BIND_SOURCE_ADDR before connect(). gloo binds its listener to the
 * address of GLOO_SOCKET_IFNAME but connects without binding, so the kernel would pick the destination's
 * own address as source and per-address-pair tc filters could not tell the nodes apart. Nothing else
 * changes: the socket, the data and the algorithms are gloo's own.
 * Build: gcc -shared -fPIC -O2 -o bind_source.so bind_source.c -ldl */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static int (*real_connect)(int, const struct sockaddr *, socklen_t);
    if (!real_connect) real_connect = dlsym(RTLD_NEXT, "connect");
    const char *src = getenv("BIND_SOURCE_ADDR");
    if (src && addr && addr->sa_family == AF_INET) {
        struct sockaddr_in me;
        memset(&me, 0, sizeof me);
        me.sin_family = AF_INET;
        if (inet_pton(AF_INET, src, &me.sin_addr) == 1) bind(fd, (struct sockaddr *)&me, sizeof me);
    }
    return real_connect(fd, addr, len);
}
