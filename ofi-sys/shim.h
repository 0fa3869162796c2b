/* What bindgen reads: libfabric's headers, and the shim's wrappers of their static inline
 * calls (fi_domain, fi_write, fi_cq_read, ... are inline: nothing to link against). */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

int railyard_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int railyard_fi_domain(struct fid_fabric *fabric, struct fi_info *info,
                       struct fid_domain **domain, void *context);
int railyard_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
                         void *context);
int railyard_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
                        void *context);
int railyard_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
                        void *context);
int railyard_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int railyard_fi_enable(struct fid_ep *ep);
int railyard_fi_getname(struct fid_ep *ep, void *addr, size_t *addrlen);
int railyard_fi_close(struct fid *fid);
int railyard_fi_av_insert(struct fid_av *av, const void *addr, size_t count,
                          fi_addr_t *fi_addr, uint64_t flags, void *context);
int railyard_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);
int railyard_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
                       uint64_t offset, uint64_t requested_key, uint64_t flags,
                       struct fid_mr **mr, void *context);
int railyard_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int railyard_fi_mr_enable(struct fid_mr *mr);
uint64_t railyard_fi_mr_key(struct fid_mr *mr);
void *railyard_fi_mr_desc(struct fid_mr *mr);
ssize_t railyard_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t railyard_fi_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t railyard_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t railyard_fi_cq_readfrom(struct fid_cq *cq, void *buf, size_t count, fi_addr_t *src_addr);
ssize_t railyard_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *railyard_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data,
                                    char *buf, size_t len);
