"""miaohui.models"""
