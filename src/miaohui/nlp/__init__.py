"""miaohui.nlp"""
