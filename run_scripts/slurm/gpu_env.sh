#!/usr/bin/env bash
# Sourced by run_scripts/slurm/hacpo.slurm and ray_node.sh: clear_foreign_gpu_env unsets the
# GPU selection variables that do not belong to the cluster's GPU vendor.
#
# Slurm 22.05 sets CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES, ZE_AFFINITY_MASK and
# GPU_DEVICE_ORDINAL together when gres.conf gives a GPU no vendor (no Flags=nvidia_gpu_env /
# amd_gpu_env, no AutoDetect), and verl's Worker refuses to start with ROCR_VISIBLE_DEVICES
# beside CUDA_VISIBLE_DEVICES. Ray workers inherit the raylet's environment, so this runs in
# every Ray step before `ray start` and in the batch step before the trainer.
#
#   GPU_VENDOR  nvidia | amd [amd where /dev/kfd exists, else nvidia]

clear_foreign_gpu_env() {
    local vendor=${GPU_VENDOR:-}
    if [[ -z $vendor ]]; then
        if [[ -e /dev/kfd ]]; then vendor=amd; else vendor=nvidia; fi
    fi
    case $vendor in
        nvidia) unset ROCR_VISIBLE_DEVICES HIP_VISIBLE_DEVICES ZE_AFFINITY_MASK GPU_DEVICE_ORDINAL ;;
        # verl turns ROCR_VISIBLE_DEVICES into CUDA_VISIBLE_DEVICES itself
        amd) unset CUDA_VISIBLE_DEVICES HIP_VISIBLE_DEVICES ZE_AFFINITY_MASK ;;
        *)
            echo "error: GPU_VENDOR=$vendor: expected nvidia or amd" >&2
            return 2
            ;;
    esac
}
