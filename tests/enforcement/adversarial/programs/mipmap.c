/* cuMipmappedArrayCreate (issue 17): every level of a mipmapped array is device memory.
 * 8192 x 8192 x float4 is 1 GiB at level 0; with 14 levels about 1.33 GiB. Three of them
 * under a 4 GiB cap (with a 512 MiB context): the third must be refused. */
#include "hostile.h"

int main(void) {
    setup();
    CUDA_ARRAY3D_DESCRIPTOR d = {0};
    d.Width = 8192;
    d.Height = 8192;
    d.Depth = 0;
    d.Format = CU_AD_FORMAT_FLOAT;
    d.NumChannels = 4;
    for (int i = 0; i < 3; i++) {
        CUmipmappedArray m;
        say("mipmap", cuMipmappedArrayCreate(&m, &d, 14));
    }
    hold();
    return 0;
}
